"""Outer steps: what the global parameters do with the average of what the ranks sent (update mode)."""

from __future__ import annotations

import functools
import math
import typing
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_sparse.wire import Average
from lightning_sparse.wire.context import BY_COUNT


class OuterStep:
    """How an exchange's average is applied to the global parameters; every rank runs it on the same average.

    Example:
        >>> class Halved(OuterStep):
        ...     def apply(self, average, target, names):
        ...         target.add_(average.add_to(torch.zeros_like(target)), alpha=0.5)
        >>> Halved().state_dict()
        {}
    """

    def apply(self, average: Average, target: Tensor, names: tuple[str, ...]) -> None:
        """Apply ``average`` in place to ``target``, the flat global values of the parameters ``names``."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The step's state (empty when it has none)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def hand_over(self, average: Average, target: Tensor) -> None:
        """Add an average of the end-of-fit hand-over (what the processes had not sent) as it is, like the exact
        hand-over's mean residual: no outer learning rate or momentum; chosen coordinates scaled as in :meth:`apply`."""
        average.add_to(target, chosen_scale_of(getattr(self, "chosen_scale", "parties"), average.parties))


def chosen_scale_of(setting: float | str, parties: int) -> float | str:
    """What :meth:`Average.add_to <lightning_sparse.wire.Average.add_to>` takes for a ``chosen_scale`` setting
    in an exchange among ``parties`` processes: ``"parties"`` is the count rule above 2 parties, 1 at 2."""
    if setting == "parties":
        return BY_COUNT if parties > 2 else 1.0
    return float(setting)


def check_chosen_scale(value: object) -> float | str:
    """``value`` if it is a ``chosen_scale`` (``"parties"`` or a finite number > 0), else ValueError."""
    if value == "parties":
        return "parties"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return value
    raise ValueError(f"chosen_scale={value!r} is not allowed: expected 'parties' or a finite number > 0.")


class AddAverage(OuterStep):
    """Add the average into the global parameters, at the coordinates sent: update mode's default outer step.

    Args:
        chosen_scale: how the coordinates each party chose on its own arrive (gather compressors):
            ``"parties"``, the count rule (a coordinate ``c`` of the ``N`` parties chose gets their sum divided
            by ``max(c, 2)``: the plain average at 2 parties and where every party chose it, twice it where
            one of 4 did; the split exchange, whose sums carry no count, multiplies the average by
            ``max(1, N/2)``), or a number > 0 that multiplies the average (1: the plain average).

    Example:
        >>> AddAverage().chosen_scale, AddAverage(chosen_scale=1.0).state_dict()
        ('parties', {})
    """

    def __init__(self, chosen_scale: float | str = "parties") -> None:
        self.chosen_scale = check_chosen_scale(chosen_scale)

    def apply(self, average: Average, target: Tensor, names: tuple[str, ...]) -> None:
        average.add_to(target, chosen_scale_of(self.chosen_scale, average.parties))


class OptimizerStep(OuterStep):
    """An optimizer stepped on the global parameters with the negated average as their gradient (DiLoCo's outer
    step, Douillard et al., 2023); one per group exchanged together, the same on every rank.

    Args:
        factory: makes an optimizer from a list of parameters (an optimizer class, a partial).
        chosen_scale: as :class:`AddAverage`'s (the same default, the count rule), applied to the
            optimizer's gradient; 1 is DiLoCo's plain average.

    Example:
        >>> step = OptimizerStep(functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True))
        >>> step.chosen_scale, step.state_dict()
        ('parties', {})
    """

    def __init__(self, factory: Callable[[Iterable[Any]], Optimizer], chosen_scale: float | str = "parties") -> None:
        self.factory = factory
        self.chosen_scale = check_chosen_scale(chosen_scale)
        self._groups: dict[tuple[str, ...], tuple[torch.nn.Parameter, Optimizer]] = {}
        self._pending: dict[str, Any] = {}

    def apply(self, average: Average, target: Tensor, names: tuple[str, ...]) -> None:
        entry = self._groups.get(names)
        if entry is None:
            param = torch.nn.Parameter(target, requires_grad=True)
            optimizer = self.factory([param])
            saved = self._pending.pop("|".join(names), None)
            if saved is not None:
                optimizer.load_state_dict(saved)
            entry = self._groups[names] = (param, optimizer)
        param, optimizer = entry
        if param.data.data_ptr() != target.data_ptr() or param.shape != target.shape:
            param.data = target
        scale = chosen_scale_of(self.chosen_scale, average.parties)
        param.grad = average.add_to(torch.zeros_like(target), scale).neg_()
        optimizer.step()
        param.grad = None

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state of every group, by the group's parameter names."""
        return {**self._pending, **{"|".join(names): opt.state_dict() for names, (_, opt) in self._groups.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (applied to each group when it is next used)."""
        self._groups = {}
        self._pending = dict(state)


class StagedAverage:
    """An average for offloaded global values: added on the device and copied back, for the same bits."""

    def __init__(self, average: Average, device: torch.device) -> None:
        self.average = average
        self.device = device
        self.parties = average.parties

    def add_to(self, out: Tensor, chosen_scale: float | str = 1.0) -> Tensor:
        staged = out.to(self.device, copy=True)
        self.average.add_to(staged, chosen_scale)
        out.copy_(staged)
        return out


def outer_step_for(setting: Callable[[Iterable[Any]], Optimizer] | OuterStep | None) -> OuterStep:
    """The outer step of a resolved ``outer_optimizer`` setting (None: :class:`AddAverage`)."""
    if isinstance(setting, OuterStep):
        return setting
    return AddAverage() if setting is None else OptimizerStep(setting)


def resolve_outer_optimizer(
    value: Any, momentum: float | None = None
) -> Callable[[Iterable[Any]], Optimizer] | OuterStep | None:
    """``outer_optimizer`` as a factory of optimizers or an outer step, else ValueError (a factory is tried
    once here, rather than failing at the first exchange); ``momentum``: ``outer_momentum``, for ``"nesterov"``."""
    if momentum is not None:
        if value != "nesterov":
            raise ValueError(
                f"outer_momentum={momentum!r} is not allowed with outer_optimizer={value!r}: it sets the momentum of "
                "outer_optimizer='nesterov'; give another optimizer its momentum in its factory, or leave "
                "outer_momentum at None."
            )
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 < momentum < 1.0:
            raise ValueError(f"outer_momentum={momentum!r} is not allowed: expected None or a number in (0, 1).")
    if value is None or isinstance(value, OuterStep):
        return value
    if value == "nesterov":  # DiLoCo's outer step (Douillard et al., 2023)
        momentum = 0.9 if momentum is None else float(momentum)
        return functools.partial(torch.optim.SGD, lr=0.7, momentum=momentum, nesterov=True)
    allowed = (
        "expected None (add the average), 'nesterov' (SGD lr 0.7, momentum 0.9, Nesterov), a torch.optim.Optimizer "
        "class or a callable that makes one from a list of parameters, or an OuterStep instance"
    )
    if isinstance(value, str) or not callable(value):
        raise ValueError(f"outer_optimizer={value!r} is not allowed: {allowed}.")
    try:
        made = value([torch.nn.Parameter(torch.zeros(1))])
    except Exception as error:
        raise ValueError(
            f"outer_optimizer={value!r} is not allowed: calling it on a parameter list failed ({error}); {allowed}."
        ) from error
    if not isinstance(made, Optimizer):
        raise ValueError(f"outer_optimizer={value!r} is not allowed: it made a {type(made).__name__}; {allowed}.")
    return typing.cast(Callable[[Iterable[Any]], Optimizer], value)
