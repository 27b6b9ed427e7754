"""Helpers the benchmark scripts share: percentiles, calling from a fresh thread, and
how busy the rest of the machine was while a phase ran (figures taken while other
work runs are skewed)."""

from __future__ import annotations

import os
import threading


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (q in 0..100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _proc_stat() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs, from /proc/stat; None where it is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


class OtherLoad:
    """CPU used by processes other than this one and its (reaped) children between
    ``start()`` and ``stop()``, as a share of the whole machine: other work on the box
    (tests, builds) that skews the figures. Read it once the children have exited."""

    def start(self) -> "OtherLoad":
        self.stat0, self.times0, self.loadavg0 = _proc_stat(), os.times(), os.getloadavg()
        return self

    def stop(self) -> float | None:
        stat1, times1 = _proc_stat(), os.times()
        self.loadavg1 = os.getloadavg()
        if self.stat0 is None or stat1 is None:
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        ours = sum(getattr(times1, k) - getattr(self.times0, k) for k in ("user", "system", "children_user", "children_system"))
        busy = (stat1[0] - self.stat0[0]) / ticks
        total = (stat1[1] - self.stat0[1]) / ticks
        return max(busy - ours, 0.0) / max(total, 1e-9)

    def report(self) -> dict:
        """``stop()``, with the load averages at both ends."""
        share = self.stop()
        return {"other_cpu_share": share, "loadavg_start": self.loadavg0, "loadavg_end": self.loadavg1}


def in_worker_thread(fn):
    """Call ``fn()`` in a fresh thread (as a server's engine loop runs) and return its result."""
    box: dict = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name="benchmark-call")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
