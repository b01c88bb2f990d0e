"""The shaped link: a network namespace whose loopback ``tc`` limits to the benchmark's rate and delay."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

#: the packet size on the shaped link (bytes)
MTU = 1500


class ShapedLink:
    """A network namespace whose loopback is limited to ``rate`` bits/s (tbf) with ``delay`` s (netem).

    Use as a context manager; :meth:`wrap` prefixes a command so it runs inside the namespace.
    The namespace is deleted on exit, whatever happened.
    """

    def __init__(self, rate_bits: float, delay_s: float = 0.0) -> None:
        self.rate_bits = rate_bits
        self.delay_s = delay_s
        self.name = f"lsbench{os.getpid()}"

    @staticmethod
    def unavailable() -> str | None:
        """Why a shaped link cannot be made here (None when it can)."""
        if not hasattr(os, "geteuid") or os.geteuid() != 0:
            return "shaping the link needs root (network namespaces and tc)"
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            return f"shaping the link needs iproute2 ({', '.join(missing)} not found; apt-get install iproute2)"
        return None

    def _run(self, *cmd: str) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.stdout.strip()}")

    def __enter__(self) -> ShapedLink:
        self._run("ip", "netns", "add", self.name)
        try:
            ns = ("ip", "netns", "exec", self.name)
            # An Ethernet MTU, so that the token bucket can be small: with loopback's 64 KiB packets
            # it had to hold 256 KiB, and an exchange of that size crossed at memory speed whenever
            # the link had been idle for a moment (a small exchange was then never shaped at all).
            self._run(*ns, "ip", "link", "set", "lo", "mtu", str(MTU))
            self._run(*ns, "ip", "link", "set", "lo", "up")
            rate = f"{int(self.rate_bits)}bit"
            # tbf needs a bucket of at least one packet and about rate/HZ; a queue of 200 ms at the
            # rate before it drops (a link's buffer; drops make TCP's throughput erratic)
            burst = max(8 * MTU, int(self.rate_bits / 8 / 250))
            tbf = ("tbf", "rate", rate, "burst", str(burst), "latency", "200ms")
            if self.delay_s > 0:
                delay = f"{self.delay_s * 1e6:.0f}us"
                try:
                    self._run(*ns, "tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "netem", "delay", delay)
                except RuntimeError as err:
                    raise RuntimeError(
                        f"--latency needs the kernel's netem queueing discipline (module sch_netem), which this "
                        f"machine does not offer ({err}); run with --latency 0"
                    ) from err
                self._run(*ns, "tc", "qdisc", "add", "dev", "lo", "parent", "1:1", "handle", "10:", *tbf)
            else:
                self._run(*ns, "tc", "qdisc", "add", "dev", "lo", "root", *tbf)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)

    def wrap(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]


def describe_link(rate_bits: float | None, delay_s: float) -> str:
    if rate_bits is None:
        return "unshaped loopback"
    rate = f"{rate_bits / 1e9:g} Gbit/s" if rate_bits >= 1e9 else f"{rate_bits / 1e6:g} Mbit/s"
    return f"{rate} loopback (tc tbf in a network namespace)" + (f", +{delay_s * 1e3:g} ms delay" if delay_s else "")
