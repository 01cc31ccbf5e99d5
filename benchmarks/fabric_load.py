"""The machine's other load while a benchmark runs: its busy cores that are not this process's or its descendants'.

A thread samples, every ``interval`` seconds, the machine's busy CPU time (``/proc/stat``) and the CPU time of
this process's tree (the harness, its Ray cluster, the driver processes and everything they start): the
difference is the work of everything else on the machine (another test run, say), which slows every contender's
wall times. Per process in the tree: its own CPU time and that of its children it reaped, so a process that ends
between two samples is counted by its parent, not lost (a process whose parent ended first, or whose parent never
reaps it, as Ray's raylet ignores SIGCHLD, loses what it spent since the last sample: the other load errs high by
it).
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

import psutil


def _busy_s() -> float:
    """The machine's busy CPU seconds so far (every core): all but idle and I/O wait (guest time is in user)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def _tree() -> dict[int, tuple[int, float, float]]:
    """pid -> (parent pid, CPU seconds of it and its reaped children, of those children alone) for this process and
    its descendants."""
    root = psutil.Process()
    tree = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            with process.oneshot():
                times, ppid = process.cpu_times(), process.ppid()
        except psutil.Error:  # it ended since the listing
            continue
        reaped = times.children_user + times.children_system
        tree[process.pid] = (ppid, times.user + times.system + reaped, reaped)
    return tree


def _counted_twice(last: dict[int, tuple[int, float, float]], now: dict[int, tuple[int, float, float]]) -> float:
    """The CPU of processes that ended since ``last`` which their parents' reaped children's now count again.

    A parent that waited for an ended child adds all the child's CPU to its own children's; one that ignores
    SIGCHLD (Ray's raylet, whose workers end throughout a Tune search) adds nothing, so at most what the parent's
    reaped children's grew by is counted twice."""
    ended: dict[int, float] = {}
    for pid, (ppid, cpu, _) in last.items():
        if pid not in now and ppid in now and ppid in last:
            ended[ppid] = ended.get(ppid, 0.0) + cpu
    return sum(min(cpu, max(now[ppid][2] - last[ppid][2], 0.0)) for ppid, cpu in ended.items())


class OtherLoad:
    """``with OtherLoad() as load: ...``; then ``load.cores(start, end)``: the other load's mean busy cores."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        # (time, the other load's CPU seconds since the first sample)
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="other-load", daemon=True)
        self._last: tuple[float, dict[int, tuple[int, float, float]]] | None = None

    def __enter__(self) -> OtherLoad:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        now, busy, tree = time.time(), _busy_s(), _tree()
        if self._last is None:
            other = 0.0
        else:
            last_busy, last_tree = self._last
            ours = sum(cpu - last_tree[pid][1] if pid in last_tree else cpu for pid, (_, cpu, _) in tree.items())
            other = self.samples[-1][1] + (busy - last_busy) - ours + _counted_twice(last_tree, tree)
        self._last = (busy, tree)
        self.samples.append((now, other))

    def _at(self, when: float) -> float | None:
        """The other load's CPU seconds at ``when``, linear between two samples; None outside them."""
        for (t0, c0), (t1, c1) in zip(self.samples, self.samples[1:]):
            if t0 <= when <= t1:
                return c0 + (c1 - c0) * (when - t0) / (t1 - t0) if t1 > t0 else c0
        return None

    def cores(self, start: float, end: float) -> float | None:
        """The other load's mean busy cores between ``start`` and ``end`` (``time.time()``); None where not sampled."""
        first, last = self._at(start), self._at(end)
        if first is None or last is None or end <= start:
            return None
        return max(last - first, 0.0) / (end - start)
