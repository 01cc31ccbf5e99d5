"""What each rank's training steps spend their time on, measured in the rank and sent with its heartbeat.

:class:`StepClock` keeps, per rank, the seconds of every training step spent in each :data:`PHASES` entry, and
the steps: the loop's hooks (``HeartbeatCallback``) move it from phase to phase with one ``perf_counter`` and
one addition, nothing is sent from the training thread, and the heartbeat's thread reads its totals once per
interval (:meth:`StepClock.snapshot`). Its first marks of the phases before training (``startup``) tell where
the time between ``fit`` and the first step went.

Phases: ``data`` (from a step's end to the next one's start: Lightning fetches the next batch), ``compute``
(forward and backward, without ``collective``), ``collective`` (DDP: the time backward waits for the gradient
all-reduce after the rank's own gradients are done, i.e. for the others and the network, as DDP's reducer
timed it in its latest sampled iteration (:func:`ray_lightning._torch.allreduce_wait_probe`; its first ten, then
one in a hundred); where nothing reports it (Horovod, sharded strategies), part of ``compute``), ``optimizer``
(from ``on_before_optimizer_step`` to the step's end) and ``checkpoint`` (saving on the training thread,
whatever phase it interrupted).

Growth: per rank, nothing per byte and two additions per step; its totals (six numbers) and start-up marks ride on
its heartbeat, one report per interval through the driver's queue (the driver: a median over the ranks per interval,
:mod:`ray_lightning.launch.stragglers`). The loggers' curves: an all-gather of six numbers per rank at most every 50
steps, and rank 0 logs five scalars per rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PHASES = ("data", "compute", "collective", "optimizer", "checkpoint")
DATA, COMPUTE, COLLECTIVE, OPTIMIZER, CHECKPOINT = range(len(PHASES))
IDLE = -1
PROBE_EVERY = 50  # steps between two reads of the all-reduce wait (DDP samples one iteration in a hundred)


class StepClock:
    """One rank's phase totals (seconds), training steps, and first times of its start-up marks."""

    def __init__(self) -> None:
        self.totals = [0.0] * len(PHASES)
        self.steps = 0
        self.startup: dict[str, float] = {}  # a start-up mark -> when (time.time()) it was first passed
        self._phase = IDLE
        self._since = 0.0
        self._credit = 0.0  # seconds of the current phase that went to a checkpoint instead
        # Seconds a backward waits for the all-reduce after its own gradients (the strategy sets the probe).
        self.wait_probe: Callable[[], float | None] | None = None
        self._wait = 0.0
        self._saving: float | None = None  # when the checkpoint being saved began

    def mark_startup(self, name: str) -> None:
        self.startup.setdefault(name, time.time())

    def enter(self, phase: int) -> None:
        """The phase now running (``IDLE``: none of a training step's, e.g. validation)."""
        self.checkpoint_done()  # where the saving's own end was not seen (a sharded strategy's)
        now = time.perf_counter()
        if self._phase != IDLE:
            self.totals[self._phase] += now - self._since - self._credit
        self._credit = 0.0
        self._phase, self._since = phase, now

    def backward_done(self) -> None:
        """Backward returned: compute, but for the latest measured wait for the all-reduce."""
        if self.wait_probe is not None and (self.steps < 10 or self.steps % PROBE_EVERY == 0):
            wait = self.wait_probe()  # DDP timed this backward itself if it was one of its samples
            if wait is not None:
                self._wait = wait
        if self._phase == COMPUTE:
            self.checkpoint_done()
            now = time.perf_counter()
            spent = now - self._since - self._credit
            wait = min(self._wait, max(spent, 0.0))
            self.totals[COMPUTE] += spent - wait
            self.totals[COLLECTIVE] += wait
            self._credit = 0.0
            self._phase, self._since = OPTIMIZER, now
        else:
            self.enter(OPTIMIZER)

    def step_done(self) -> None:
        self.steps += 1
        self.enter(DATA)

    def checkpoint_started(self) -> None:
        """The training thread begins to save a checkpoint (Lightning builds its dict: ``on_save_checkpoint``)."""
        self._saving = time.perf_counter()

    def checkpoint_done(self) -> None:
        """The checkpoint is saved (or handed to a background writer): its time is the checkpoint's, not the
        phase's it interrupted."""
        if self._saving is None:
            return
        seconds, self._saving = time.perf_counter() - self._saving, None
        self.totals[CHECKPOINT] += seconds
        if self._phase != IDLE:
            self._credit += seconds

    def snapshot(self) -> tuple:
        """``(steps, *seconds per phase)``, cumulative for the call."""
        return (self.steps, *self.totals)


@dataclass
class RankTimes:
    """A rank's steps and the seconds of each phase over them (``trainer.strategy.timings[rank]``)."""

    steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    node: str = ""

    @classmethod
    def of(cls, snapshot: tuple, node: str = "") -> RankTimes:
        return cls(int(snapshot[0]), dict(zip(PHASES, snapshot[1:])), node)

    def minus(self, earlier: RankTimes) -> RankTimes:
        return RankTimes(
            self.steps - earlier.steps, {p: self.seconds[p] - earlier.seconds[p] for p in PHASES}, self.node
        )

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per step of each phase (0 without steps)."""
        return {p: s * 1000 / self.steps if self.steps else 0.0 for p, s in self.seconds.items()}

    @property
    def step_ms(self) -> float:
        return sum(self.per_step_ms().values())

    def busy_ms(self) -> float:
        """A step's own work: every phase but the wait for the others (``collective``)."""
        ms = self.per_step_ms()
        return sum(v for p, v in ms.items() if p != "collective")


def table(timings: dict[int, RankTimes]) -> str:
    """Every rank's milliseconds per step of each phase, as a small text table."""
    header = f"{'rank':>4} {'node':<15} {'steps':>6} " + " ".join(f"{p:>10}" for p in PHASES) + f" {'step':>8}"
    lines = ["ray_lightning: where each rank's training steps went (ms per step)", header]
    for rank in sorted(timings):
        times = timings[rank]
        ms = times.per_step_ms()
        cells = " ".join(f"{ms[p]:>10.2f}" for p in PHASES)
        lines.append(f"{rank:>4} {times.node[:15]:<15} {times.steps:>6} {cells} {times.step_ms:>8.2f}")
    return "\n".join(lines)


def log_interval(trainer: Any, clock: StepClock, since: list[float]) -> None:
    """Every rank's milliseconds per step of each phase since the last call, logged by rank 0 through the
    Trainer's loggers as ``timings/rank<r>/<phase>_ms`` (a small all-gather: every rank calls this at the same
    steps). ``since``: this rank's snapshot at the last call, updated in place."""
    import torch

    now = clock.snapshot()
    delta = [a - b for a, b in zip(now, since)] if since else list(now)
    since[:] = now
    gathered = trainer.strategy.all_gather(torch.tensor(delta, dtype=torch.float64))
    if trainer.global_rank != 0 or not trainer.loggers:
        return
    rows = gathered.reshape(-1, len(delta)).tolist()
    metrics = {}
    for rank, row in enumerate(rows):
        steps = row[0]
        for phase, seconds in zip(PHASES, row[1:]):
            metrics[f"timings/rank{rank}/{phase}_ms"] = seconds * 1000 / steps if steps else 0.0
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def startup_breakdown(driver: dict[str, float], rank_zero: dict[str, float]) -> list[tuple[str, float, float]]:
    """Where the time between ``fit`` and the first step went: every start-up mark of the driver's and rank 0's as
    ``(mark, seconds since fit was called, seconds since the mark before)``, in time order. Marks of a worker
    process from before the call (a worker kept from the last one) are left out. (The workers' clocks are their
    nodes'.)"""
    start = driver.get("fit called (driver)")
    if start is None:
        return []
    marks = sorted((t, name) for name, t in {**driver, **rank_zero}.items() if t >= start)
    out, before = [], start
    for t, name in marks:
        out.append((name, t - start, t - before))
        before = t
    return out


def breakdown_text(breakdown: list[tuple[str, float, float]]) -> str:
    """:func:`startup_breakdown` as lines: seconds since ``fit``, seconds since the mark before, the mark."""
    return "\n".join(f"{since:8.2f} s  (+{step:6.2f} s)  {name}" for name, since, step in breakdown)
