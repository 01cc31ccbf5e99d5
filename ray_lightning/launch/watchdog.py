"""The driver's watchdog: a rank that makes no progress for longer than its bound stops the call.

Every rank reports its progress (:mod:`ray_lightning.channel.heartbeat`); :class:`Watchdog` keeps,
per rank, the newest report and when it changed. A rank in a startup phase (starting the call,
unpickling, ``init_hook``, the rendezvous) may stay there ``worker_start_timeout_s``; later phases
(setup, every batch of every loop) ``progress_timeout_s`` (None: unbounded).

When a bound passes, the running ranks furthest behind (fewest events) are the stuck ones, whether
or not their own bound passed first: the others wait for them in a collective. The error names them
and their phase, shows every rank's phase, and every rank's Python stack at that moment (:mod:`.stacks`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ray_lightning.channel.heartbeat import ProgressReport
from ray_lightning.errors import WorkerHangError
from ray_lightning.launch.actor import NodeInfo
from ray_lightning.launch.stragglers import StepTimes


@dataclass
class _Seen:
    report: ProgressReport
    since: float  # when its count last changed (the driver's clock)
    finished: bool = False  # its call returned: nothing more to wait for


class Watchdog:
    """Progress of the ranks of one call. ``ranks[i]``/``infos[i]``: actor ``i``'s global rank and place."""

    def __init__(
        self,
        ranks: Sequence[int],
        infos: Sequence[NodeInfo],
        progress_timeout_s: float | None,
        start_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ranks = list(ranks)
        self._infos = list(infos)
        self._progress_timeout_s = progress_timeout_s
        self._start_timeout_s = start_timeout_s
        self._clock = clock
        now = self._checked_at = clock()
        self._seen = {rank: _Seen(ProgressReport(rank, 0, "starting the call"), now) for rank in ranks}
        # What the reports carry besides progress: the step times (stragglers named as they show) and when each
        # rank passed its start-up phases.
        self.times = StepTimes(self._ranks, [i.node_ip for i in self._infos])
        self.startup_marks: dict[int, dict[str, float]] = {}

    def record(self, report: ProgressReport) -> None:
        seen = self._seen.get(report.rank)
        if seen is not None and report.count > seen.report.count:
            self._seen[report.rank] = _Seen(report, self._clock())
            self.times.record(report.rank, report.times)
            self.startup_marks[report.rank] = dict(report.marks)

    def finished(self, rank: int) -> None:
        """``rank``'s call returned; it is no longer watched."""
        if rank in self._seen:
            self._seen[rank].finished = True

    def _bound(self, report: ProgressReport) -> float | None:
        return self._start_timeout_s if report.startup else self._progress_timeout_s

    def _watched(self) -> list[tuple[int, _Seen, float]]:
        """``(rank, what was seen, its bound)`` of every rank still running with a bound."""
        return [
            (rank, seen, bound)
            for rank, seen in self._seen.items()
            if not seen.finished and (bound := self._bound(seen.report)) is not None
        ]

    def seconds_left(self) -> float | None:
        """Until the first bound passes (0 if one has); None when nothing is bounded."""
        now = self._clock()
        left = [seen.since + bound - now for _, seen, bound in self._watched()]
        return max(0.0, min(left)) if left else None

    def overdue(self) -> list[int]:
        now = self._checked_at = self._clock()
        return [rank for rank, seen, bound in self._watched() if now - seen.since >= bound]

    def hang_error(self, overdue: list[int], stacks: Sequence[str]) -> WorkerHangError:
        """The error once ``overdue`` ranks passed their bound; ``stacks[i]`` is actor ``i``'s stack.

        The stuck ranks are the furthest behind of all running ranks, overdue or not: a rank that
        stopped later than the one it waits for (it reached the collective after the other stopped)
        passes its bound first, yet it is the other that is stuck.
        """
        running = [r for r, seen in self._seen.items() if not seen.finished] or list(overdue)
        behind = min(self._seen[r].report.count for r in running)
        stuck = sorted(r for r in running if self._seen[r].report.count == behind)
        first = self._seen[stuck[0]].report
        trigger = self._seen[overdue[0]].report if overdue else first
        bound = self._bound(trigger)
        setting = "worker_start_timeout_s" if trigger.startup else "progress_timeout_s"
        waited = self._checked_at - self._seen[stuck[0]].since
        names = ", ".join(f"rank {r}" for r in stuck)
        lines = [
            f"ray_lightning: {names} made no progress for {waited:.0f} s ({setting}={bound:g}), stuck in "
            f"{first.describe()}. All workers have been stopped. Where every rank was:"
        ]
        for rank in sorted(self._seen):
            seen = self._seen[rank]
            if seen.finished:
                lines.append(f"  rank {rank}: finished its part of the call")
                continue
            state = " (stuck)" if rank in stuck else ""
            idle = self._checked_at - seen.since
            lines.append(f"  rank {rank}{state}: {seen.report.describe()}, no progress for {idle:.0f} s")
        lines.append(
            f"Raise {setting} if this phase legitimately takes longer (None switches the progress watchdog off)."
        )
        for i in sorted(range(len(self._ranks)), key=lambda i: self._ranks[i]):
            info = self._infos[i] if i < len(self._infos) else None
            where = f"node {info.node_ip}, pid {info.pid}" if info else "unknown node"
            stack = stacks[i] if i < len(stacks) else "(no stack)"
            lines.append(f"--- Python stack of rank {self._ranks[i]} ({where}) ---\n{stack}")
        return WorkerHangError("\n".join(lines), rank=stuck[0], ranks=stuck, phase=first.describe())
