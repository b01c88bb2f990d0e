"""Error-feedback residuals, one flat fp32 tensor per parameter name (DDP's buckets change; names stay put)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


class ErrorFeedback:
    """What each parameter has not sent yet: ``e <- (g + e) - sent``, exactly (float32 whatever the gradients).

    Example:
        >>> import torch
        >>> ef = ErrorFeedback()
        >>> p = ef.accumulate("w", torch.tensor([1.0, 2.0, 3.0]))   # p = g + e (e starts at 0)
        >>> ef.keep_unsent("w", torch.tensor([2]))  # p[2] was sent exactly
        >>> ef.get("w")
        tensor([1., 2., 0.])
    """

    def __init__(self) -> None:
        self._residuals: dict[str, Tensor] = {}
        # names whose buffer is known to hold zeros without having been zeroed (saves a pass)
        self._zero: set[str] = set()
        #: where offloaded residuals live between exchanges (None: with their parameters)
        self.home: torch.device | None = None
        self._staged: dict[str, Tensor] = {}
        self._flats: dict[tuple[tuple[str | None, int], ...], tuple[Tensor, list[tuple[str, Tensor]]]] = {}

    def _buffer(self, name: str) -> Tensor | None:
        """The residual of ``name``: its device copy while staged."""
        staged = self._staged.get(name)
        return staged if staged is not None else self._residuals.get(name)

    def __contains__(self, name: str) -> bool:
        """Whether ``name`` has a residual that may be non-zero."""
        return name in self._residuals and name not in self._zero

    def held(self, names: Iterable[str]) -> dict[str, Tensor]:
        """The residuals of those of ``names`` that may be non-zero, by name, in one call."""
        residuals, zero, staged = self._residuals, self._zero, self._staged
        return {n: staged.get(n, residuals[n]) for n in names if n in residuals and n not in zero}

    def __len__(self) -> int:
        return len(self._residuals)

    def names(self) -> list[str]:
        return list(self._residuals)

    def get(self, name: str) -> Tensor | None:
        """The residual of ``name`` (None if it never had one)."""
        e = self._buffer(name)
        if e is not None and name in self._zero:
            e.zero_()
            self._zero.discard(name)
        return e

    def flat(self, layout: tuple[tuple[str | None, int], ...], device: torch.device) -> Tensor | None:
        """One flat float32 tensor laid out as ``layout`` (``(name, numel)``; a ``None`` name stays zero) whose
        regions *are* the residuals (views), made once per layout; None when offloaded.

        Example:
            >>> ef = ErrorFeedback()
            >>> _ = ef.accumulate("w", torch.tensor([1.0, 2.0]))
            >>> e = ef.flat((("w", 2), (None, 1), ("v", 1)), torch.device("cpu"))
            >>> e, ef.get("w").data_ptr() == e.data_ptr()
            (tensor([1., 2., 0., 0.]), True)
        """
        if self.home is not None:
            return None
        cached = self._flats.get(layout)
        if cached is not None and cached[0].device == device:
            buf, views = cached
            residuals, zero = self._residuals, self._zero
            for name, view in views:
                if residuals.get(name) is not view:
                    break
            else:
                if zero:
                    for name, view in views:
                        if name in zero:
                            view.zero_()
                            zero.discard(name)
                return buf
        names = {n for n, _ in layout if n is not None}
        for key in [k for k in self._flats if any(n in names for n, _ in k if n is not None)]:
            del self._flats[key]  # a name belongs to one flat buffer at a time
        buf = torch.zeros(sum(n for _, n in layout), dtype=torch.float32, device=device)
        views = []
        pos = 0
        for region, numel in layout:
            if region is not None:
                view = buf[pos : pos + numel]
                old = self._residuals.get(region)
                if old is not None and region not in self._zero and old.numel() == numel:
                    view.copy_(old)
                self._residuals[region] = view
                self._zero.discard(region)
                views.append((region, view))
            pos += numel
        self._flats[layout] = (buf, views)
        return buf

    def accumulate(self, name: str, grad: Tensor) -> Tensor:
        """Add the flat gradient into the residual in place and return it: ``p = g + e`` (fp32; offloaded: staged)."""
        if self.home is not None and name not in self._staged:
            master = self._residuals.get(name)
            if master is not None and master.numel() == grad.numel():
                self._staged[name] = master.to(grad.device, copy=True)
        store = self._staged if self.home is not None else self._residuals
        e = store.get(name)
        if e is None or e.numel() != grad.numel() or e.device != grad.device:
            e = grad.to(torch.float32, copy=True)
            store[name] = e
        elif name in self._zero:
            e.copy_(grad)
        else:
            e.add_(grad)
        self._zero.discard(name)
        return e

    def keep_unsent(self, name: str, indices: Tensor, remainder: Tensor | None = None) -> None:
        """After a send of ``p[indices]``: ``remainder`` stays there (None: 0), so ``sent + e_new == p`` exactly."""
        e = self._buffer(name)
        assert e is not None
        if remainder is None:
            e.index_fill_(0, indices, 0.0)
        else:
            e.index_copy_(0, indices, remainder.to(torch.float32))

    def flush(self, name: str, sent_as: torch.dtype) -> Tensor | None:
        """Hand the whole residual over for a dense send, cast to ``sent_as``; only the rounding error stays (in
        float32: the residual's own buffer, valid until the next :meth:`accumulate` of ``name``)."""
        e = self._buffer(name)
        if e is None or name in self._zero:
            return None
        if sent_as == torch.float32:
            self._zero.add(name)
            return e
        sent = e.to(sent_as)
        e.sub_(sent.to(torch.float32))
        return sent

    def unstage(self, names: list[str] | None = None) -> None:
        """Offloaded: write the device copies of ``names`` (default: all) back to :attr:`home` and drop them."""
        if not self._staged:
            return
        for name in list(self._staged) if names is None else names:
            staged = self._staged.pop(name, None)
            if staged is None:
                continue
            master = self._residuals.get(name)
            if master is None or master.numel() != staged.numel():
                pin = staged.is_cuda and self.home is not None and self.home.type == "cpu"
                master = torch.empty(staged.numel(), dtype=torch.float32, device=self.home, pin_memory=pin)
                self._residuals[name] = master
            master.copy_(staged)

    def copy(self, name: str) -> Tensor | None:
        """A copy of the residual of ``name`` (None if it has no buffer), for :meth:`put`."""
        e = self._buffer(name)
        if e is None:
            return None
        return torch.zeros_like(e) if name in self._zero else e.clone()

    def put(self, name: str, residual: Tensor | None) -> None:
        """Set the residual of ``name`` to ``residual`` (a :meth:`copy`; None: no buffer)."""
        self._zero.discard(name)
        if residual is None:
            self._residuals.pop(name, None)
        else:
            self._residuals[name] = residual

    def scale_(self, factor: float) -> None:
        """Multiply every residual by ``factor`` (e.g. when a gradient scaler changes its scale)."""
        self.unstage()
        for name, e in self._residuals.items():
            if name not in self._zero:
                e.mul_(factor)

    def clear(self) -> None:
        self._flats.clear()
        self._residuals.clear()
        self._staged.clear()
        self._zero.clear()

    def norm_sq(self) -> float:
        """Sum of squared residual entries over all parameters (one host read)."""
        self.unstage()
        return sum_of_squares([e for name, e in self._residuals.items() if name not in self._zero])

    def state_dict(self, copy: bool = True) -> dict[str, Tensor]:
        """The residuals by name, on the CPU; ``copy=False`` hands out the CPU ones themselves."""
        self.unstage()
        zero = self._zero
        return {n: torch.zeros(e.numel()) if n in zero else _on_cpu(e, copy) for n, e in self._residuals.items()}

    def load_state_dict(self, state: dict[str, Tensor], device: torch.device | None = None) -> None:
        self.clear()
        self._residuals = _loaded(state, self.home if self.home is not None else device)


class LocalMomentum:
    """DGC momentum correction (Lin et al., 2018): local momenta ``u <- m*u + g`` (float32, by name), error
    feedback on ``u``, sent coordinates zeroed in ``u`` too (momentum factor masking).

    Example:
        >>> import torch
        >>> mom = LocalMomentum()
        >>> mom.update("w", torch.ones(3), 0.9)
        tensor([1., 1., 1.])
        >>> mom.update("w", torch.ones(3), 0.9)
        tensor([1.9000, 1.9000, 1.9000])
    """

    def __init__(self) -> None:
        self._velocity: dict[str, Tensor] = {}

    def get(self, name: str) -> Tensor | None:
        return self._velocity.get(name)

    def update(self, name: str, grad: Tensor, momentum: float) -> Tensor:
        """``u <- momentum * u + g`` in place (a copy of g the first time); returns u (float32)."""
        u = self._velocity.get(name)
        if u is None or u.numel() != grad.numel() or u.device != grad.device:
            u = grad.to(torch.float32, copy=True)
            self._velocity[name] = u
        else:
            u.mul_(momentum).add_(grad)
        return u

    def put(self, name: str, velocity: Tensor | None) -> None:
        """Set the local momentum of ``name`` (None: none)."""
        if velocity is None:
            self._velocity.pop(name, None)
        else:
            self._velocity[name] = velocity

    def mask(self, name: str, indices: Tensor) -> None:
        """Zero the momentum at the coordinates just sent."""
        u = self._velocity.get(name)
        if u is not None:
            u.index_fill_(0, indices, 0.0)

    def scale_(self, factor: float) -> None:
        for u in self._velocity.values():
            u.mul_(factor)

    def state_dict(self, copy: bool = True) -> dict[str, Tensor]:
        """The local momenta by name, on the CPU (``copy=False``: the CPU ones themselves)."""
        return {name: _on_cpu(u, copy) for name, u in self._velocity.items()}

    def load_state_dict(self, state: dict[str, Tensor], device: torch.device | None = None) -> None:
        self._velocity = _loaded(state, device)


def sum_of_squares(tensors: list[Tensor]) -> float:
    """The sum of the squares of every entry of ``tensors``, in float32 or wider, with one host read.

    Example:
        >>> sum_of_squares([torch.tensor([3.0]), torch.tensor([4.0], dtype=torch.bfloat16)])
        25.0
    """
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.dtype, t.device), []).append(t.detach())
    total = 0.0
    for (dtype, _), ts in groups.items():
        wide = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        total += float(torch.stack(torch._foreach_norm(ts, 2, dtype=wide)).double().square().sum())
    return total


def _on_cpu(t: Tensor, copy: bool) -> Tensor:
    t = t.detach()
    return t.cpu().clone() if copy or t.device.type != "cpu" else t


def _loaded(state: dict[str, Tensor], device: torch.device | None) -> dict[str, Tensor]:
    return {name: t.detach().to(device=device, dtype=torch.float32).reshape(-1).clone() for name, t in state.items()}


class ShapedResiduals:
    """Each parameter's residual in the parameter's shape, made once per residual (a view costs an operator).

    Example:
        >>> shaped, e = ShapedResiduals(), torch.zeros(6)
        >>> [v.shape for v in shaped.of(["w"], [e], [torch.ones(2, 3)])]
        [torch.Size([2, 3])]
        >>> shaped.of(["w"], [e], [torch.ones(2, 3)])[0] is shaped.of(["w"], [e], [e])[0]
        True
    """

    def __init__(self) -> None:
        self._held: dict[str, tuple[Tensor, Tensor]] = {}

    def of(self, names: list[str], residuals: list[Tensor], params: list[Tensor]) -> list[Tensor]:
        shaped, held = [], self._held
        for name, e, p in zip(names, residuals, params, strict=True):
            found = held.get(name)
            if found is None or found[0] is not e:
                found = held[name] = (e, e.view_as(p))
            shaped.append(found[1])
        return shaped
