"""Named points of the compression frontier, each named by its byte reduction against dense DDP.

Each exchanges the top 1 % to 0.8 % of each tensor in 2-bit values every ``sync_every`` steps, with SparseLoCo's outer
step and decayed error feedback, and hands over in a few exchanges at the end of fit."""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

_OUTER = {"outer_optimizer": "nesterov", "value_bits": 2, "warmup_steps": 0}
_DECAYED = {**_OUTER, "error_feedback_decay": 0.9}
_LONG = {"sync_every": 32, **_OUTER, "error_feedback_decay": 0.8, "flush_at_end": 1}  # the long cycles
#: the presets, by name: the settings each one sets
PRESETS: dict[str, dict[str, Any]] = {
    "1000x": {"sync_every": 4, **_DECAYED, "outer_momentum": 0.8, "flush_at_end": 8},
    "2000x": {"sync_every": 8, **_DECAYED, "outer_momentum": 0.8, "flush_at_end": 8},
    "4000x": {"sync_every": 16, **_DECAYED, "outer_momentum": 0.8, "flush_at_end": 4},
    "8000x": {**_LONG, "outer_momentum": 0.8},
    "10000x": {**_LONG, "density": 0.008, "outer_momentum": 0.85},
}
