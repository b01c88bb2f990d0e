"""A replica group's process under watch: SIGTERM and SIGINT obeyed anywhere, and no wait past its bound."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["CHILD_GRACE_S", "WATCHDOG_GRACE_S", "Guard"]

#: a wait that outlives the bound torchft's own timeouts give it by this many seconds ends the process
WATCHDOG_GRACE_S = 15.0
#: seconds a leaving process's children get to exit after its signal, before they are killed
CHILD_GRACE_S = 3.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _children() -> list[int]:
    """The process ids of this process's children, from ``/proc`` (Linux)."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{os.getpid()}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{os.getpid()}/task/{task}/children") as f:
                found.update(int(p) for p in f.read().split())
    return sorted(found)


def _end_children(signum: int) -> None:
    """Send this process's children ``signum``; kill those still there after :data:`CHILD_GRACE_S` seconds."""
    pids = _children()
    _send(pids, signum)
    end = time.monotonic() + CHILD_GRACE_S
    while pids and time.monotonic() < end:
        pids = [p for p in pids if _running(p)]
        time.sleep(0.05)
    _send(pids, signal.SIGKILL)


def _send(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signum)


def _running(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == 0


class Guard:
    """Ends this process on SIGTERM or SIGINT wherever it is, and when a wait outlives its deadline.

    torchft's calls block the main thread, where Python runs no signal handler until they return, so it acts from
    threads of its own (a pipe from :func:`signal.set_wakeup_fd`, a watchdog), its children signalled first.

    Args:
        where: the process's place and step in words, called when a line is written.

    Example:
        >>> guard = Guard(lambda: "replica group 0 at its step 0")
        >>> with guard.waiting("a quorum", 30.0):
        ...     guard.activity
        'waiting for a quorum'
        >>> guard.activity
        'training'
    """

    def __init__(self, where: Callable[[], str]) -> None:
        self.where = where
        self._what: str | None = None
        self._deadline = 0.0
        self._lock = threading.Lock()
        self._leaving = False
        self._pipe: tuple[int, int] | None = None
        self._previous: dict[int, Any] = {}
        self._previous_fd = -1
        self._stop = threading.Event()

    @property
    def activity(self) -> str:
        """What the process is doing, in words."""
        return "training" if self._what is None else f"waiting for {self._what}"

    def install(self) -> None:
        """Catch SIGTERM and SIGINT and start the watchdog (from the main thread; elsewhere only the watchdog)."""
        if threading.current_thread() is threading.main_thread():
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._pipe = (read, write)
            for sig in _SIGNALS:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, lambda signum, frame: self.leave(signum))
            self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            threading.Thread(target=self._read_signals, name="lightning_sparse_signals", daemon=True).start()
        threading.Thread(target=self._watch, name="lightning_sparse_watchdog", daemon=True).start()

    def close(self) -> None:
        """Give the signals back to their former handlers and stop the threads."""
        self._stop.set()
        if self._pipe is None:
            return
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._previous_fd)
            for sig, handler in self._previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        with contextlib.suppress(OSError):
            os.write(self._pipe[1], b"\0")  # wakes the reader, which then ends

    @contextlib.contextmanager
    def waiting(self, what: str, bound: float) -> Iterator[None]:
        """Waits for ``what`` at most ``bound`` seconds (torchft's timeouts) plus :data:`WATCHDOG_GRACE_S`."""
        outer = (self._what, self._deadline)
        self._what, self._deadline = what, time.monotonic() + bound + WATCHDOG_GRACE_S
        try:
            yield
        finally:
            self._what, self._deadline = outer

    def _read_signals(self) -> None:
        assert self._pipe is not None
        while not self._stop.is_set():
            try:
                data = os.read(self._pipe[0], 64)
            except OSError:
                return
            for signum in data:
                if signum in _SIGNALS:
                    self.leave(signum)

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            what, deadline = self._what, self._deadline
            if what is not None and time.monotonic() > deadline:
                self.leave(
                    0,
                    f"{what} did not end within the bound of torchft's timeouts plus {WATCHDOG_GRACE_S:g} s"
                    " (torchft did not honour its timeout); the other groups go on without it",
                )

    def leave(self, signum: int, why: str = "") -> None:
        """End the process now: one line on stderr, the children ended, status ``128 + signum`` (1 for 0)."""
        with self._lock:
            if self._leaving:
                if threading.current_thread() is threading.main_thread():
                    while True:  # another thread is ending the process: the main thread goes no further
                        time.sleep(1.0)
                return
            self._leaving = True
        if signum:
            name = signal.Signals(signum).name
            why = (
                f"got {name} while {self.activity}: leaving the replica groups and exiting with status "
                f"{128 + signum}; the other groups go on without it (start it again to rejoin: it heals from them)"
            )
        line = f"lightning_sparse: {self.where()}: {why}\n"
        with contextlib.suppress(OSError):
            os.write(2, line.encode("utf-8", "replace"))
        _end_children(signum or signal.SIGTERM)
        os._exit(128 + signum if signum else 1)
