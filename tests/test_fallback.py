"""The timed dense fallback on one process: arguments, trial schedule, windows, state.

Its behaviour on real process groups (the choice, the same on every rank, kept on resume) is
tested in test_hook_dist.py and test_reliability.py.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from torch.futures import Future

from lightning_sparse import SparseDDPStrategy, TimedFallback
from lightning_sparse.exchange import fallback as fallback_module
from lightning_sparse.exchange.fallback import as_fallback


def _bound(fb: TimedFallback, world: int = 2, warmup: int = 1, step: int = 0) -> TimedFallback:
    fb.setup(None, world, warmup, torch.device("cpu"))
    return fb


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"trial_steps": 1}, r"trial_steps=1 is not allowed: expected an integer >= 2"),
        ({"trial_steps": 2.5}, r"trial_steps=2.5 is not allowed: expected an integer"),
        ({"recheck_every": -1}, r"recheck_every=-1 is not allowed: expected an integer >= 0"),
    ],
)
def test_bad_arguments_raise(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        TimedFallback(**kwargs)


@pytest.mark.parametrize("value", ["fast", 1, None, 0.5])
def test_strategy_rejects_other_fallback_values(value: Any) -> None:
    with pytest.raises(ValueError, match=rf"fallback_to_dense={value!r} is not allowed: expected True or 'bytes'"):
        SparseDDPStrategy(fallback_to_dense=value)


def test_fallback_values() -> None:
    assert as_fallback(True) == (True, None) and as_fallback("bytes") == (True, None)
    assert as_fallback(False) == (False, None)
    on, timed = as_fallback("time")
    assert on and isinstance(timed, TimedFallback) and timed.config() == {"trial_steps": 5, "recheck_every": 0}
    mine = TimedFallback(trial_steps=3)
    assert as_fallback(mine) == (True, mine)
    state = SparseDDPStrategy(fallback_to_dense="time").sparse_state
    assert state.config.byte_rule is True and isinstance(state.config.timed_fallback, TimedFallback)
    assert "TimedFallback(trial_steps=5, recheck_every=0)" in str(state.fingerprint())


def test_trial_schedule() -> None:
    fb = _bound(TimedFallback(trial_steps=3, recheck_every=10), warmup=2)
    fb.begin_step(0)  # warm-up steps are not part of the trial; it starts after them
    assert fb.trial_start == 2
    assert [fb.kind(s) for s in range(2, 8)] == ["trial dense"] * 3 + ["trial sparse"] * 3
    assert fb.kind(8) == "sparse"  # no choice yet: sparse, with the byte rule
    one = _bound(TimedFallback(), world=1)
    one.begin_step(5)
    assert one.kind(5) == "sparse" and one.trial_start is None  # one process: nothing to time


def test_windows_skip_the_first_step_of_each_half(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter(range(100))
    monkeypatch.setattr(fallback_module, "clock", lambda: float(next(ticks)))
    fb = _bound(TimedFallback(trial_steps=3))
    for step in range(1, 7):
        fb.begin_step(step)
        done: Future[torch.Tensor] = Future()
        done.set_result(torch.zeros(1))
        fb.track(done).wait()
    fb._close_window()
    # steps 2, 3 (dense) and 5, 6 (sparse) were timed: each window is one tick of the clock
    assert fb.samples == {"sparse": [1.0, 1.0], "dense": [1.0, 1.0]}


def test_state_round_trip_and_world_size_change() -> None:
    fb = _bound(TimedFallback(trial_steps=2))
    fb.choice, fb.trial_start = "dense", None
    fb.decisions = [{"step": 5, "sparse_s": 0.2, "dense_s": 0.1, "choice": "dense", "trial_start": 1}]
    assert fb.describe() == (
        "timed fallback at step 5: exchange window sparse 200.0 ms, dense 100.0 ms (trial median, slowest rank) "
        "-> dense"
    )
    assert TimedFallback().describe() is None
    saved = fb.state_dict()
    again = _bound(TimedFallback(trial_steps=2))
    again.load_state_dict(saved)
    assert again.state_dict() == saved and again.kind(100) == "dense"
    clone = pickle.loads(pickle.dumps(again))
    assert clone.state_dict() == saved and clone._group is None
    # restored on another number of processes: the choice is dropped and a new trial runs
    other = _bound(TimedFallback(trial_steps=2), world=4, step=40)
    other.load_state_dict(saved)
    assert other.choice is None
    other.begin_step(40)
    assert other.trial_start == 40 and other.kind(40) == "trial dense"
