"""On the driver: every rank's step times as their heartbeats bring them, the rank that holds the others back named
while the fit runs, and the call's totals (``trainer.strategy.timings``).

An interval ends when every rank has reported since the last one ended (each reports once per heartbeat interval
while it trains). A rank is a straggler when, for :data:`INTERVALS` intervals in a row, its steps without the time
it waits for the others (:meth:`~ray_lightning.channel.timings.RankTimes.busy_ms`: in DDP the fast ranks wait in
the all-reduce, the slow one does not) take at least :data:`RATIO` times the other ranks' median. It is named
once, with its node, its phases against the others' and what to look at, from the phase that exceeds most.
Growth: per report, one subtraction per phase; per interval, a median over the ranks.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence

from ray_lightning.channel.timings import PHASES, RankTimes

log = logging.getLogger(__name__)

RATIO = 1.3
INTERVALS = 3
LEAST_MS = 1.0  # a difference below this many ms per step is noise, whatever the ratio
ADVICE = {
    "data": "its data loading is slow: look at the preprocessing and I/O on that node (more loader workers, "
    "faster storage, or the preprocessing moved to Ray Data tasks on other nodes)",
    "compute": "its forward and backward are slow: a slower device, or another process on its node (a noisy neighbour)",
    "optimizer": "its optimizer step is slow: a slower device, or another process on its node",
    "checkpoint": "it blocks on saving checkpoints: look at the storage it writes to",
    "collective": "it waits longer in the all-reduce than the others: look at its network",
}


class StepTimes:
    """The step times of one call's ranks (``ranks[i]`` on node ``nodes[i]``); ``say``: where a straggler is named."""

    def __init__(self, ranks: Sequence[int], nodes: Sequence[str], say: Callable[[str], None] = log.warning) -> None:
        self._nodes = dict(zip(ranks, nodes))
        self._latest = {rank: RankTimes(node=node) for rank, node in self._nodes.items()}
        self._start = dict(self._latest)  # each rank's totals when the current interval began
        self._waiting = set(self._nodes)
        self._slow: dict[int, int] = dict.fromkeys(self._nodes, 0)  # intervals in a row each rank was slow
        self._named: set[int] = set()
        self._say = say

    def record(self, rank: int, snapshot: tuple) -> None:
        """A heartbeat's cumulative ``(steps, *seconds per phase)`` of ``rank``."""
        if rank not in self._nodes or not snapshot:
            return
        self._latest[rank] = RankTimes.of(snapshot, self._nodes[rank])
        self._waiting.discard(rank)
        if not self._waiting:
            self._judge({r: self._latest[r].minus(self._start[r]) for r in self._nodes})
            self._start, self._waiting = dict(self._latest), set(self._nodes)

    def _judge(self, interval: dict[int, RankTimes]) -> None:
        trained = {r: t for r, t in interval.items() if t.steps > 0}
        if len(trained) < 2:
            return
        busy = {r: t.busy_ms() for r, t in trained.items()}
        for rank, times in trained.items():
            others = statistics.median(v for r, v in busy.items() if r != rank)
            slow = busy[rank] >= RATIO * others and busy[rank] - others >= LEAST_MS
            self._slow[rank] = self._slow[rank] + 1 if slow else 0
            if self._slow[rank] >= INTERVALS and rank not in self._named:
                self._named.add(rank)
                self._say(straggler_message(rank, times, [t for r, t in trained.items() if r != rank]))

    @property
    def named(self) -> set[int]:
        """The ranks named as stragglers so far."""
        return set(self._named)

    def result(self) -> dict[int, RankTimes]:
        """Every rank's totals for the call."""
        return dict(self._latest)


def straggler_message(rank: int, times: RankTimes, others: Sequence[RankTimes]) -> str:
    """What the log says of a straggler: its node, its phases against the other ranks' median, what to look at."""
    mine = times.per_step_ms()
    theirs = {p: statistics.median(o.per_step_ms()[p] for o in others) for p in PHASES}
    ratio = times.busy_ms() / max(statistics.median(o.busy_ms() for o in others), 1e-9)
    excess = max(PHASES, key=lambda p: mine[p] - theirs[p])
    phases = ", ".join(f"{p} {mine[p]:.1f} ms against {theirs[p]:.1f}" for p in PHASES)
    return (
        f"ray_lightning: rank {rank} (node {times.node}) holds the others back: its steps take {ratio:.1f}x the "
        f"other ranks' (median), not counting the time they wait for each other, for {INTERVALS} intervals in a "
        f"row. Per step: {phases}. Most of the difference is {excess}: {ADVICE[excess]}."
    )
