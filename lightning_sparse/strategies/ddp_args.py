"""The keyword arguments of DistributedDataParallel a sparse strategy takes, checked at construction."""

from __future__ import annotations

import inspect
from typing import Any

from torch.nn.parallel import DistributedDataParallel

__all__ = ["check_ddp_kwargs"]

# DDP arguments that would install a second communication hook or average models behind ours.
_CONFLICTING_DDP_ARGS = {
    "mixed_precision": "DDP's mixed_precision installs its own communication hook, which would replace the "
    "sparse one; use Trainer(precision='bf16-mixed') or 'bf16-true' instead",
    "ddp_comm_hook": "SparseDDPStrategy installs its own communication hook",
    "ddp_comm_state": "SparseDDPStrategy installs its own communication hook and state",
    "ddp_comm_wrapper": "SparseDDPStrategy installs its own communication hook",
    "model_averaging_period": "post-local-SGD model averaging does not combine with sparse gradients",
}


def check_ddp_kwargs(ddp_kwargs: dict[str, Any] | None, honoured: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The further ``DistributedDataParallel`` arguments, checked: ValueError for one that would install a second
    communication hook or that neither DDP (this torch's) nor ``honoured`` (what update mode's replicas take in
    DDP's place) takes; one given as None is dropped."""
    extra = dict(ddp_kwargs or {})
    for name, why in _CONFLICTING_DDP_ARGS.items():
        if extra.get(name) is not None:
            raise ValueError(f"{name}={extra[name]!r} is not allowed with SparseDDPStrategy: {why}.")
        extra.pop(name, None)  # None: none of it (what the Lightning CLI passes)
    allowed = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"} | honoured
    for name in extra:
        if name not in allowed:
            raise ValueError(
                f"{name}={extra[name]!r} is not allowed: it is an argument of neither SparseDDPStrategy nor "
                f"DistributedDataParallel, which takes {', '.join(sorted(allowed))}."
            )
    return extra
