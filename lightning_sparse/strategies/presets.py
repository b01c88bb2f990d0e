"""Named points of the compression frontier: a bandwidth budget instead of five arguments.

Each preset exchanges the top 1 % of each tensor in 2-bit values every ``sync_every`` steps, with an end-of-fit
hand-over of a few exchanges; from 16 steps on with a Nesterov outer step (momentum 0.8 at 16 steps) and decayed
error feedback. The name is its byte reduction against dense DDP (``docs/results.md``, "Presets").
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS", "preset_settings"]

_LOCAL = {"value_bits": 2, "warmup_steps": 0}
_LONG = {"outer_optimizer": "nesterov", **_LOCAL}  # from 16 steps on, with decayed error feedback
#: the presets, by name: the settings each one sets
PRESETS: dict[str, dict[str, Any]] = {
    "1000x": {"sync_every": 4, **_LOCAL, "flush_at_end": 16},
    "2000x": {"sync_every": 8, **_LOCAL, "flush_at_end": 8},
    "4000x": {"sync_every": 16, **_LONG, "outer_momentum": 0.8, "error_feedback_decay": 0.9, "flush_at_end": 4},
    "8000x": {"sync_every": 32, **_LONG, "error_feedback_decay": 0.9, "flush_at_end": 2},
    "10000x": {"sync_every": 40, **_LONG, "error_feedback_decay": 0.8, "flush_at_end": 1},
}


def preset_settings(name: str) -> dict[str, Any]:
    """The settings of preset ``name`` (a copy), or ValueError naming the presets there are."""
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is not allowed: expected one of {list(PRESETS)}.")
    return dict(PRESETS[name])
