"""The checkpoint payload: every rank's sparse state, written at a save and restored per rank.

At a save every rank's state (residuals, step, schedule, telemetry; in update mode its optimizer
states and the outer step's state) is gathered to rank 0 and written under
:data:`CHECKPOINT_KEY`; at a load each rank takes its own again, or, on another number of
processes, the mean of the saved ones (``docs/guarantees.md``). Both front ends carry it through
:class:`CheckpointPayload`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_sparse.state import SparseState
from lightning_sparse.update import UpdateExchange

__all__ = ["CHECKPOINT_KEY", "CheckpointPayload", "mean_states"]

#: key of the sparse state inside Lightning checkpoints (Trainer and Fabric)
CHECKPOINT_KEY = "lightning_sparse"


class CheckpointPayload:
    """Saves and restores one rank's sparse state through the strategy's checkpoints.

    Args:
        state: this rank's :class:`~lightning_sparse.state.SparseState`.
        update: the update exchange (update mode), else None.

    Example:
        >>> payload = CheckpointPayload(SparseState(compressor="topk"), None)
        >>> saved = payload.gather()          # one process: its own state
        >>> saved["world_size"], saved["ranks"][0]["step"]
        (1, 0)
    """

    def __init__(self, state: SparseState, update: UpdateExchange | None) -> None:
        self.state = state
        self.update = update
        self._pending_payload: dict[str, Any] | None = None
        #: every rank's optimizer states from a loaded checkpoint (update mode), by rank
        self._pending_optimizer_states: list[Any] | None = None

    def gather(self, optimizer_states: Any = None) -> dict[str, Any] | None:
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
        """Restore a payload written by :meth:`gather`: this rank's residuals, step,
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

    def apply_pending(self, rank: int, world_size: int, device: torch.device) -> None:
        """Apply a payload that :meth:`restore` held until the model was set up (once)."""
        if self._pending_payload is not None:
            self._apply(self._pending_payload, rank, world_size, device)
            self._pending_payload = None

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
        if saved_mode != state.config.compress:
            rank_zero_warn(
                f"lightning_sparse: the checkpoint was written with compress={saved_mode!r} and is resumed with "
                f"compress={state.config.compress!r}; its error-feedback residuals (unsent {saved_mode}s) are dropped."
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
