"""The core shared by the Trainer and the Fabric strategies.

:class:`SparseCore` holds everything of ``SparseDDPStrategy`` that does not depend on which
Lightning front end runs it: the :class:`~lightning_sparse.config.SparseConfig`, the
:class:`SparseState` and the :class:`UpdateExchange`, the DDP keyword arguments, the registration
of the communication hook on a DDP model, the checks of the optimizers, and the checkpoint payload
(every rank's residuals, and in update mode every rank's optimizer state, gathered to rank 0 and
restored per rank). :class:`SparseShell` is what the two strategies share on top of it (their
properties and the update-mode optimizer step); ``lightning_sparse.strategy.SparseDDPStrategy``
(Trainer) and ``lightning_sparse.fabric.SparseDDPStrategy`` (Fabric) are thin shells over both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_sparse.amp import SkippedSteps
from lightning_sparse.config import SparseConfig
from lightning_sparse.hook import sparse_comm_hook
from lightning_sparse.outer import outer_step_for
from lightning_sparse.state import SparseState
from lightning_sparse.update import UpdateExchange, average_optimizer_states, update_comm_hook

#: key of the hook state inside Lightning checkpoints (Trainer and Fabric)
CHECKPOINT_KEY = "lightning_sparse"

# DDP arguments that would install a second communication hook or average models behind ours.
_CONFLICTING_DDP_ARGS = {
    "mixed_precision": "DDP's mixed_precision installs its own communication hook, which would replace the "
    "sparse one; use Trainer(precision='bf16-mixed') or 'bf16-true' instead",
    "ddp_comm_hook": "SparseDDPStrategy installs its own communication hook",
    "ddp_comm_state": "SparseDDPStrategy installs its own communication hook and state",
    "ddp_comm_wrapper": "SparseDDPStrategy installs its own communication hook",
    "model_averaging_period": "post-local-SGD model averaging does not combine with sparse gradients",
}

#: the registered names, with their descriptions and fixed arguments (Trainer and Fabric registries)
STRATEGY_NAMES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("sparse_ddp", "sparse DDP (top-k 1% + error feedback), start_method 'popen'", {"start_method": "popen"}),
    ("sparse_ddp_spawn", "sparse DDP, start_method 'spawn'", {"start_method": "spawn"}),
    ("sparse_ddp_fork", "sparse DDP, start_method 'fork'", {"start_method": "fork"}),
    ("sparse_ddp_notebook", "sparse DDP, start_method 'fork'", {"start_method": "fork"}),
    (
        "sparse_ddp_find_unused_parameters_true",
        "sparse DDP with find_unused_parameters=True, start_method 'popen'",
        {"start_method": "popen", "find_unused_parameters": True},
    ),
    (
        "sparse_ddp_spawn_find_unused_parameters_true",
        "sparse DDP with find_unused_parameters=True, start_method 'spawn'",
        {"start_method": "spawn", "find_unused_parameters": True},
    ),
)


def register_names(cls: type, registry: Any) -> None:
    """Register :data:`STRATEGY_NAMES` for ``cls`` in a Trainer or Fabric strategy registry (idempotent)."""
    for name, description, params in STRATEGY_NAMES:
        if name in registry and registry[name].get("strategy") is cls:
            continue
        registry.register(name, cls, description=description, override=True, **params)


class SparseCore:
    """The sparse communication of one strategy: configuration, state, hook, checkpoint payload.

    Builds the :class:`SparseState`, the :class:`UpdateExchange` (update mode) and the keyword
    arguments of ``DistributedDataParallel`` (:attr:`ddp_kwargs`) from a config.

    Args:
        config: the settings (validated when it was built).
        ddp_kwargs: further arguments of ``DistributedDataParallel``.

    Example:
        >>> core = SparseCore(SparseConfig(compressor="topk", density=0.05))
        >>> core.compress, core.ddp_kwargs["gradient_as_bucket_view"]
        ('update', True)
    """

    def __init__(self, config: SparseConfig, ddp_kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(ddp_kwargs or {})
        for name, why in _CONFLICTING_DDP_ARGS.items():
            if extra.get(name) is not None:
                raise ValueError(f"{name}={extra[name]!r} is not allowed with SparseDDPStrategy: {why}.")
            extra.pop(name, None)  # None: none of it (what the Lightning CLI passes)
        allowed = _ddp_arguments()
        for name in extra:
            if name not in allowed:
                raise ValueError(
                    f"{name}={extra[name]!r} is not allowed: it is an argument of neither SparseDDPStrategy nor "
                    f"DistributedDataParallel, which takes {', '.join(sorted(allowed))}."
                )
        self.config = config
        self.state = SparseState(config)
        #: the update exchange (``compress="update"``), else None
        self.update: UpdateExchange | None = None
        if config.compress == "update":
            cap = 25.0 if config.bucket_cap_mb is None else float(config.bucket_cap_mb)
            outer = outer_step_for(config.outer_factory)
            self.update = UpdateExchange(self.state, bucket_bytes=int(cap * 1024 * 1024), outer_step=outer)
        #: keyword arguments of DistributedDataParallel
        self.ddp_kwargs: dict[str, Any] = {**extra, **config.ddp_kwargs}
        self._pending_payload: dict[str, Any] | None = None
        #: every rank's optimizer states from a loaded checkpoint (update mode), by rank
        self._pending_optimizer_states: list[Any] | None = None

    @property
    def compress(self) -> str:
        """``"update"`` or ``"gradient"``."""
        return self.state.compress

    # ------------------------------------------------------------------ the hook
    def register_hook(
        self,
        model: torch.nn.Module | None,
        rank: int,
        world_size: int,
        device: torch.device,
        scaler: Any = None,
        optimizers: Callable[[], list[Any]] | None = None,
    ) -> None:
        """Apply a checkpoint payload that waited for the model, bind the state to the model's
        parameters and process group, and register the communication hook (on any device).

        ``scaler``: the precision plugin's gradient scaler (fp16 AMP), if any. ``optimizers``: the
        strategy's optimizers (update mode: their states are averaged when a timed fallback takes the
        ranks to plain DDP steps).
        """
        if not isinstance(model, DistributedDataParallel):
            raise RuntimeError(f"expected the model wrapped in DistributedDataParallel, got {type(model).__name__}")
        if self._pending_payload is not None:
            self._apply(self._pending_payload, rank, world_size, device)
            self._pending_payload = None
        enabled = scaler is not None and getattr(scaler, "is_enabled", lambda: True)()
        self.state.skips = SkippedSteps(scaler) if enabled else None
        if self.update is not None:
            # each rank keeps its own gradient; the exchange runs after the optimizer step
            update = self.update
            update.bind(model.module.named_parameters(), process_group=model.process_group)
            group = model.process_group
            if optimizers is not None:
                update.on_dense = lambda: average_optimizer_states(optimizers(), group)
            model.register_comm_hook(self.state, update_comm_hook)
            return
        self.state.loss_scale = None if self.state.skips is None else self.state.skips.scale
        self.state.bind(model.module.named_parameters(), process_group=model.process_group)
        model.register_comm_hook(self.state, sparse_comm_hook)

    def check_optimizers(self, optimizers: list[Any], world_size: int) -> None:
        """Refuse an optimizer momentum under momentum correction; warn (rank 0) about combinations
        measured to train far from dense."""
        if self.state.momentum_correction:
            _check_no_optimizer_momentum(optimizers, self.state.momentum_correction)
        if world_size > 1:
            for advice in training_advice(self.state, optimizers):
                rank_zero_warn(f"lightning_sparse: {advice}")

    def hold_global(self) -> None:
        """Update mode: put the global parameters back in the module (no-op otherwise)."""
        if self.update is not None:
            self.update.leave_local()

    # ------------------------------------------------------------------ checkpoints
    def gather_payload(self, optimizer_states: Any = None) -> dict[str, Any] | None:
        """This rank's state (and, in update mode, its ``optimizer_states``) gathered to rank 0.

        A collective on every rank; returns ``{"world_size": W, "ranks": [state of rank r]}`` on
        rank 0 and None on the other ranks.
        """
        mine = self.state.state_dict()
        if self.update is not None:
            mine["outer_step"] = self.update.outer_step.state_dict()  # the same on every rank
        if self.update is not None and optimizer_states is not None:
            # each rank's optimizer followed its own gradients: Lightning keeps rank 0's only
            mine["optimizer_states"] = optimizer_states
        if _distributed_is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(mine, gathered, dst=0)
        else:
            gathered = [mine]
        if gathered is None:
            return None
        return {"world_size": len(gathered), "ranks": gathered}

    def restore(self, payload: dict[str, Any], rank: int, world_size: int, device: torch.device, now: bool) -> None:
        """Restore a payload written by :meth:`gather_payload`: this rank's residuals, step,
        schedule and telemetry (at once if ``now``, else when the hook is registered), and keep
        every rank's optimizer state for :meth:`take_optimizer_states` (update mode; on another
        world size, their mean for every rank)."""
        ranks = payload["ranks"]
        if self.update is not None and all("optimizer_states" in r for r in ranks):
            states = [r["optimizer_states"] for r in ranks]
            if int(payload["world_size"]) != world_size:
                # another number of processes: every rank starts from the mean of the saved states
                # (as the mean of the residuals below), the same on every rank
                states = [mean_states(states)] * world_size
            self._pending_optimizer_states = states
        if now:
            self._apply(payload, rank, world_size, device)
            self._pending_payload = None
        else:
            self._pending_payload = payload

    def take_optimizer_states(self, rank: int) -> Any:
        """The optimizer states rank ``rank`` saved in the restored checkpoint (once), or None."""
        pending = self._pending_optimizer_states
        self._pending_optimizer_states = None
        return None if pending is None else pending[rank]

    def _apply(self, payload: dict[str, Any], rank: int, world_size: int, device: torch.device) -> None:
        ranks: list[dict[str, Any]] = payload["ranks"]
        saved_world = int(payload["world_size"])
        state = self.state
        if saved_world == world_size:
            mine = ranks[rank]
        else:
            # Every new rank takes the mean of the old residuals: the total delayed gradient,
            # sum(e_r) / world_size, is then the same as before the change.
            rank_zero_warn(
                f"lightning_sparse: the checkpoint was written by {saved_world} processes and is resumed on "
                f"{world_size}; each rank starts from the mean of the saved error-feedback residuals, "
                "which keeps the total delayed "
                + (
                    "update (nothing is dropped) but not each rank's share of it, and from the mean of the "
                    "saved ranks' optimizer states."
                    if self.update is not None
                    else "gradient (nothing is dropped) but not each rank's share of it."
                )
            )
            mine = dict(ranks[0])
            for key in ("residuals", "velocity"):  # local momenta, like residuals, are summed over ranks
                names = {n for r in ranks for n in r.get(key, {})}
                mine[key] = {
                    n: sum(r[key][n] for r in ranks if n in r.get(key, {})) / saved_world for n in sorted(names)
                }
        saved_mode = mine.get("compress", "gradient")
        if saved_mode != state.compress:
            rank_zero_warn(
                f"lightning_sparse: the checkpoint was written with compress={saved_mode!r} and is resumed with "
                f"compress={state.compress!r}; its error-feedback residuals (unsent {saved_mode}s) are dropped."
            )
            mine = {**mine, "residuals": {}, "velocity": {}}
        saved_compressor = mine.get("compressor")
        current = type(state.compressor).__name__
        if saved_compressor != current or mine.get("compressor_config") != state.compressor.config():
            rank_zero_warn(
                f"lightning_sparse: the checkpoint was written with compressor {saved_compressor} "
                f"{mine.get('compressor_config')} and is resumed with {current} {state.compressor.config()}; "
                "the error-feedback residuals (the gradient not sent yet) are kept and sent by the new compressor."
            )
        state.load_state_dict(mine, device=device)
        if self.update is not None and "outer_step" in mine:
            self.update.outer_step.load_state_dict(mine["outer_step"])


def _ddp_arguments() -> set[str]:
    """The keyword arguments DistributedDataParallel takes (but the module)."""
    import inspect

    return set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"}


def mean_states(states: list[Any]) -> Any:
    """The element-wise mean of structurally equal states (dicts, lists, tuples of tensors and
    other values): floating tensors are averaged (in float64, then cast back), anything else is
    taken from the first.

    Example:
        >>> import torch
        >>> mean_states([{"step": 3, "m": torch.tensor([1.0, 2.0])}, {"step": 3, "m": torch.tensor([3.0, 0.0])}])
        {'step': 3, 'm': tensor([2., 1.])}
    """
    first = states[0]
    if isinstance(first, torch.Tensor):
        if not first.is_floating_point():
            return first
        total = torch.stack([s.to(device=first.device, dtype=torch.float64) for s in states]).mean(0)
        return total.to(first.dtype)
    if isinstance(first, dict):
        return {key: mean_states([s[key] for s in states]) for key in first}
    if isinstance(first, (list, tuple)):
        items = [mean_states([s[i] for s in states]) for i in range(len(first))]
        return type(first)(items) if isinstance(first, tuple) else items
    return first


def _check_no_optimizer_momentum(optimizers: list[Any], momentum: float) -> None:
    """Momentum correction moves the momentum into the hook: a second one in the optimizer would
    apply it twice, so refuse optimizers that keep one."""
    for optimizer in optimizers:
        inner = getattr(optimizer, "_optimizer", optimizer)
        for group in inner.param_groups:
            if group.get("momentum", 0) or "betas" in group:
                found = f"momentum={group['momentum']}" if group.get("momentum", 0) else f"betas={group['betas']}"
                raise ValueError(
                    f"momentum_correction={momentum} is not allowed with {type(inner).__name__}({found}): the hook "
                    "already applies the momentum, so the optimizer must have none (e.g. SGD(momentum=0)); "
                    "or set momentum_correction=0 to keep the optimizer's momentum."
                )


def training_advice(state: SparseState, optimizers: list[Any]) -> list[str]:
    """Combinations of mode, compressor and optimizer measured to train far from dense, each with
    what to change (the strategies warn with these at setup).

    Example:
        >>> import torch
        >>> opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
        >>> [a[:40] for a in training_advice(SparseState(compress="gradient"), [opt])]
        ["compress='gradient' with AdamW trains fa"]
    """
    advice = []
    inner = [getattr(o, "_optimizer", o) for o in optimizers]
    adaptive = sorted({type(o).__name__ for o in inner if any("betas" in g for g in o.param_groups)})
    momentum = any(g.get("momentum", 0) for o in inner for g in o.param_groups)
    name = state.compressor.name or type(state.compressor).__name__
    random = state.compressor.pattern == "shared"
    if state.compress == "gradient" and adaptive:
        advice.append(
            f"compress='gradient' with {', '.join(adaptive)} trains far from dense: the optimizer normalises "
            "each coordinate's rare error-feedback bursts away (measured on a small GPT with AdamW: validation "
            "loss 2.40 against 1.84 for dense DDP at density 0.01). Use compress='update' (the default)."
        )
    if state.compress == "gradient" and random and momentum:
        advice.append(
            f"compressor={name!r} with compress='gradient' and an optimizer momentum can diverge: a coordinate's "
            "whole residual enters the momentum at once when it is finally drawn (measured on the digits MLP with "
            "SGD momentum 0.9 at density 0.01: random-block 14% and random-k 64% accuracy against 97% for dense "
            "DDP; 98% in update mode). Use compress='update' (the default), or 'topk'."
        )
    # Random coordinates in update mode were measured to train well (GPT with AdamW: random-k 1.985 and
    # random-block 1.996 nats against 1.844 dense; digits 98%), so that combination gets no warning.
    return advice


class SparseShell:
    """What the Trainer and the Fabric strategies share on top of :class:`SparseCore`: the
    properties they expose and the update-mode optimizer step.

    Example:
        >>> from lightning_sparse import SparseDDPStrategy
        >>> isinstance(SparseDDPStrategy(), SparseShell)
        True
    """

    _core: SparseCore
    _in_optimizer_step: bool = False

    @property
    def sparse_state(self) -> SparseState:
        """The hook's state on this rank: residuals, step, telemetry."""
        return self._core.state

    @property
    def compress(self) -> str:
        """``"update"`` or ``"gradient"``: what is compressed."""
        return self._core.compress

    @property
    def update_exchange(self) -> UpdateExchange | None:
        """The update exchange (``compress="update"``), else None."""
        return self._core.update

    def _sparse_step(self, optimizer: Any, step: Callable[[], Any]) -> Any:
        """Run the optimizer ``step``; in update mode on this rank's view of its parameters, then
        the exchange: afterwards the module holds the new global values of those parameters."""
        update = self._core.update
        if update is None:
            output = step()
            state = self._core.state
            if state.skips is not None:  # fp16 AMP: a skipped step gives back what it took from the residuals
                state.skips.after_step(state.memory, state.velocity)
            return output
        params = [p for group in optimizer.param_groups for p in group["params"]]
        update.enter_local(params)
        self._in_optimizer_step = True
        try:
            output = step()
        finally:
            self._in_optimizer_step = False
        update.exchange(params)
        return output
