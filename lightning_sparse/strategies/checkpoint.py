"""The checkpoint payload: each process's sparse state, written by that process beside the checkpoint.

``<checkpoint>.sparse/rank00001-of-00004.pt`` (update mode: with its optimizer states), named by the checkpoint's entry
under :data:`CHECKPOINT_KEY`; another number of processes reads the mean of the saved states, a file at a time."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import _PATH

from lightning_sparse.exchange.state import SparseState
from lightning_sparse.exchange.update import UpdateExchange

__all__ = ["CHECKPOINT_KEY", "CheckpointPayload", "map_leaves", "mean_states", "read_rank_states", "rank_files_dir"]

#: key of the sparse state's entry inside Lightning checkpoints (Trainer and Fabric)
CHECKPOINT_KEY = "lightning_sparse"
#: version of the checkpoint entry: 2 is one file per process beside the checkpoint
PAYLOAD_FORMAT = 2


def rank_files_dir(path: _PATH) -> str:
    """The folder that holds the per-process files of the checkpoint at ``path``."""
    return f"{os.fspath(path)}.sparse"


def _rank_file(folder: str, rank: int, world_size: int) -> str:
    return f"{folder}/rank{rank:05d}-of-{world_size:05d}.pt"


def _folder_of(path: _PATH, entry: dict[str, Any]) -> str:
    """The folder an entry names, beside the real file behind ``path`` (``last.ckpt`` may be a link)."""
    path = os.fspath(path)
    if "://" not in path and os.path.islink(path):
        path = os.path.realpath(path)
    parent = os.path.dirname(path)
    return f"{parent}/{entry['files']}" if parent else str(entry["files"])


def _write(record: dict[str, Any], file: str, io: CheckpointIO, storage_options: Any | None) -> None:
    """Write one process's record; a local file with the default writer is streamed to disk and renamed into place
    (Lightning's writer would serialize it into memory first)."""
    if type(io) is TorchCheckpointIO and storage_options is None and "://" not in file:
        os.makedirs(os.path.dirname(file) or ".", exist_ok=True)
        torch.save(record, f"{file}.partial")
        os.replace(f"{file}.partial", file)
    else:
        io.save_checkpoint(record, file, storage_options=storage_options)


class CheckpointPayload:
    """Saves and restores one process's sparse state through the strategy's checkpoints.

    Args:
        state: this process's :class:`~lightning_sparse.exchange.state.SparseState`.
        update: the update exchange (update mode), else None.

    Example:
        >>> import tempfile
        >>> from lightning.fabric.plugins import TorchCheckpointIO
        >>> payload = CheckpointPayload(SparseState(compressor="topk"), None)
        >>> path = tempfile.mkdtemp() + "/model.ckpt"
        >>> entry = payload.save(path, 0, 1, None, TorchCheckpointIO())   # this process's file, beside path
        >>> entry["world_size"], entry["files"]
        (1, 'model.ckpt.sparse')
        >>> [r["state"]["step"] for r in read_rank_states(path, entry)]
        [0]
    """

    def __init__(self, state: SparseState, update: UpdateExchange | None) -> None:
        self.state = state
        self.update = update
        #: this process's restored state, applied when the model is set up (once)
        self._pending: dict[str, Any] | None = None

    def save(
        self,
        path: _PATH,
        rank: int,
        world_size: int,
        optimizer_states: dict[str, Any] | None,
        io: CheckpointIO,
        storage_options: Any | None = None,
        rank0_in_checkpoint: bool = True,
    ) -> dict[str, Any]:
        """Write this process's file beside ``path`` (no collective); return the checkpoint's entry.
        ``optimizer_states`` (kept in update mode: each optimizer followed its own gradients) go in the files, but
        rank 0's, which are in the checkpoint itself unless ``rank0_in_checkpoint`` is False."""
        keep_optimizers = self.update is not None and optimizer_states is not None
        record: dict[str, Any] = {"rank": rank, "world_size": world_size, "state": self.state.state_dict(copy=False)}
        if keep_optimizers and (rank != 0 or not rank0_in_checkpoint):
            record["optimizer_states"] = optimizer_states
        folder = rank_files_dir(path)
        _write(record, _rank_file(folder, rank, world_size), io, storage_options)
        entry: dict[str, Any] = {
            "format": PAYLOAD_FORMAT,
            "world_size": world_size,
            "files": os.path.basename(folder),
            "step": record["state"]["step"],
            "optimizer_keys": sorted(optimizer_states or {}) if keep_optimizers else [],
            "rank0_in_checkpoint": rank0_in_checkpoint,
        }
        if self.update is not None:
            entry["outer_step"] = self.update.outer_step.state_dict()  # the same on every process
        return entry

    @staticmethod
    def remove(path: _PATH) -> None:
        """Remove the per-process files of the checkpoint at ``path``."""
        folder = rank_files_dir(path)
        fs = get_filesystem(folder)
        if fs.exists(folder):
            fs.rm(folder, recursive=True)

    def restore(
        self,
        checkpoint: dict[str, Any],
        path: _PATH,
        rank: int,
        world_size: int,
        io: CheckpointIO,
        device: torch.device,
        now: bool,
        weights_only: bool | None = None,
    ) -> None:
        """Take :data:`CHECKPOINT_KEY` out of a loaded ``checkpoint`` and restore this process's state, at once if
        ``now``, else by :meth:`apply_pending`; update mode: with this process's optimizer states."""
        entry = checkpoint.pop(CHECKPOINT_KEY)
        if entry.get("format") != PAYLOAD_FORMAT:
            raise ValueError(
                f"checkpoint {os.fspath(path)!r} holds lightning_sparse state of format {entry.get('format')!r}; this "
                f"version reads format {PAYLOAD_FORMAT} (one file per process beside the checkpoint)."
            )
        saved_world = int(entry["world_size"])
        folder = _folder_of(path, entry)
        keys: list[str] = entry.get("optimizer_keys", [])

        def read(r: int) -> dict[str, Any]:
            file = _rank_file(folder, r, saved_world)
            if not get_filesystem(file).exists(file):
                raise FileNotFoundError(
                    f"lightning_sparse: {file!r} is missing: the checkpoint {os.fspath(path)!r} was written by "
                    f"{saved_world} processes, each with its own file in {folder!r}; copy that folder with the "
                    "checkpoint."
                )
            record = io.load_checkpoint(file, map_location="cpu", weights_only=weights_only)
            if record["state"]["step"] != entry["step"]:
                raise ValueError(
                    f"lightning_sparse: {file!r} is from step {record['state']['step']}, the checkpoint "
                    f"{os.fspath(path)!r} from step {entry['step']}: a process did not finish writing that save."
                )
            if r == 0 and keys and entry.get("rank0_in_checkpoint", True):
                record["optimizer_states"] = {k: checkpoint[k] for k in keys if k in checkpoint}
            return record

        if saved_world == world_size:
            record = read(rank)
            mine, optimizers = record["state"], record.get("optimizer_states")
        else:
            mine, optimizers = self._mean_of_saved(read, saved_world, world_size)
        if optimizers:
            checkpoint.update(optimizers)  # this process's own optimizer states (rank 0's are there already)
        self._pending = {"state": self._checked(mine), "outer_step": entry.get("outer_step")}
        if now:
            self.apply_pending(device)

    def _mean_of_saved(
        self, read: Callable[[int], dict[str, Any]], saved_world: int, world_size: int
    ) -> tuple[dict[str, Any], Any]:
        # every new process takes the mean of the old residuals: their total is kept
        delayed = "update" if self.update is not None else "gradient"
        also = ", and from the mean of the saved ranks' optimizer states" if self.update is not None else ""
        rank_zero_warn(
            f"lightning_sparse: the checkpoint was written by {saved_world} processes and is resumed on {world_size}; "
            f"each rank starts from the mean of the saved error-feedback residuals, which keeps the total delayed "
            f"{delayed} (nothing is dropped) but not each rank's share of it{also}."
        )
        first: dict[str, Any] = {}
        # local momenta are summed like residuals, in their own dtype
        sums = {key: _Mean(wide=False) for key in ("residuals", "velocity")}
        optimizers = _Mean()
        for r in range(saved_world):
            record = read(r)
            state = record["state"]
            for key, mean in sums.items():
                mean.add(state.get(key, {}))
            if "optimizer_states" in record and self.update is not None:
                optimizers.add(record["optimizer_states"])
            if r == 0:
                first = {k: v for k, v in state.items() if k not in sums}
        mine = {**first, **{key: mean.result() if mean.count else {} for key, mean in sums.items()}}
        return mine, optimizers.result() if optimizers.count else None

    def _checked(self, mine: dict[str, Any]) -> dict[str, Any]:
        """The saved state, warning where it was written under another mode (its residuals dropped) or compressor."""
        state = self.state
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
        return mine

    def apply_pending(self, device: torch.device) -> None:
        """Apply what :meth:`restore` held until the model was set up (once)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        self.state.load_state_dict(pending["state"], device=device)
        if self.update is not None and pending["outer_step"] is not None:
            self.update.outer_step.load_state_dict(pending["outer_step"])


def read_rank_states(path: _PATH, entry: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every process's saved record of the checkpoint at ``path`` (``entry``: its :data:`CHECKPOINT_KEY` entry,
    None: read from ``path``), by rank."""
    if entry is None:
        entry = torch.load(path, map_location="cpu", weights_only=False)[CHECKPOINT_KEY]
    folder = _folder_of(path, entry)
    world_size = int(entry["world_size"])
    return [torch.load(_rank_file(folder, r, world_size), map_location="cpu") for r in range(world_size)]


def map_leaves(state: Any, leaf: Callable[[Any], Any]) -> Any:
    """``state`` with ``leaf`` applied to each leaf (dicts, lists and tuples walked, a tuple's type kept)."""
    if isinstance(state, dict):
        return {key: map_leaves(value, leaf) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        items = [map_leaves(value, leaf) for value in state]
        return type(state)(items) if isinstance(state, tuple) else items
    return leaf(state)


def mean_states(states: list[Any]) -> Any:
    """The element-wise mean of structurally equal states: floating tensors averaged (in float64), anything else
    taken from the first."""
    mean = _Mean()
    for state in states:
        mean.add(state)
    return mean.result()


class _Sum:
    """A sum of floating tensors of one dtype (in float64 if ``wide``)."""

    def __init__(self, tensor: torch.Tensor, wide: bool) -> None:
        self.dtype = tensor.dtype
        self.value = tensor.detach().to(dtype=torch.float64 if wide else tensor.dtype, copy=True)


class _Mean:
    """A running element-wise mean of states, summed in float64 if ``wide``, else in each tensor's own dtype; a
    missing dict key counts as zero."""

    def __init__(self, wide: bool = True) -> None:
        self.total: Any = None
        self.count = 0
        self.wide = wide

    def add(self, state: Any) -> None:
        self.total = _summed(self.total, state) if self.count else _as_total(state, self.wide)
        self.count += 1

    def result(self) -> Any:
        return map_leaves(self.total, lambda x: x.value.div(self.count).to(x.dtype) if isinstance(x, _Sum) else x)


def _as_total(state: Any, wide: bool) -> Any:
    return map_leaves(state, lambda x: _Sum(x, wide) if isinstance(x, torch.Tensor) and x.is_floating_point() else x)


def _summed(total: Any, state: Any) -> Any:
    if isinstance(total, _Sum):
        total.value.add_(state.to(device=total.value.device, dtype=total.value.dtype))
        return total
    if isinstance(total, dict):
        for key, value in state.items():
            total[key] = _summed(total[key], value) if key in total else _as_total(value, _is_wide(total))
        return total
    if isinstance(total, (list, tuple)):
        items = [_summed(t, s) for t, s in zip(total, state, strict=True)]
        return type(total)(items) if isinstance(total, tuple) else items
    return total


def _is_wide(total: dict[str, Any]) -> bool:
    """Whether the sums in ``total`` are float64 (True where there are none)."""
    sums = [v for v in total.values() if isinstance(v, _Sum)]
    return not sums or sums[0].value.dtype == torch.float64
