"""Each rank's progress during a call, sent to the driver's watchdog (:mod:`ray_lightning.launch.watchdog`).

In a worker, :class:`Heartbeat` keeps a counter of the events the rank passed (the phases before
training, then every batch's start, backward, optimizer step and end in every loop) and the last
one's name. Marking an event is an integer increment and a tuple assignment: nothing is sent from
the training thread, and where the event is (epoch, batch) is kept as a template and its numbers,
formatted only when the report is sent. A daemon thread sends the newest state through the driver channel's queue at
most once per interval, and only when it changed, so a rank that stopped still has its last event
delivered, and a rank that trains sends one small message per interval.

:class:`HeartbeatCallback` marks the Lightning loop events; the worker marks the phases before them
(unpickling, ``init_hook``) and the strategies the rendezvous (``runtime.mark_progress``).

Messages are plain tuples, so the queue actor never imports this package.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from ray_lightning import namespaces, runtime
from ray_lightning.channel.timings import COMPUTE, DATA, IDLE, OPTIMIZER, StepClock, log_interval

if TYPE_CHECKING:
    import pytorch_lightning as pl

_TAG = "ray_lightning.progress"
# The step times go to the Trainer's loggers every log_every_n_steps steps, but at most every this many: each time
# is a small all-gather.
LOG_EVERY = 50


@dataclass(frozen=True)
class ProgressReport:
    """The newest progress of one rank: ``count`` events so far, the last in ``phase`` (``detail``: where)."""

    rank: int
    count: int
    phase: str
    detail: str = ""
    startup: bool = True  # a phase before training, bounded by worker_start_timeout_s
    times: tuple = ()  # the rank's StepClock.snapshot(): (steps, *seconds per phase), for the call so far
    marks: tuple = ()  # ((start-up mark, time.time()), ...) the rank passed so far

    def describe(self) -> str:
        return f"{self.phase} ({self.detail})" if self.detail else self.phase

    def to_message(self) -> tuple:
        return (_TAG, self.rank, self.count, self.phase, self.detail, self.startup, self.times, self.marks)

    @classmethod
    def from_message(cls, message: Any) -> ProgressReport | None:
        """The report a message carries, or None if it is something else (a driver call)."""
        if isinstance(message, tuple) and len(message) == 8 and message[0] == _TAG:
            return cls(*message[1:])
        return None


class Heartbeat:
    """This rank's progress, sent to the driver every ``interval_s`` while it changes, with its step times
    (``clock``, :mod:`.timings`)."""

    def __init__(self, rank: int, queue: Any, interval_s: float, clock: StepClock | None = None) -> None:
        self._rank = rank
        self._queue = queue
        self._interval_s = interval_s
        self.clock = clock if clock is not None else StepClock()
        self._state = (1, "starting the call", "", True)
        self._sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ray_lightning-heartbeat", daemon=True)

    def mark(self, phase: str, detail: str | tuple = "", startup: bool = False) -> None:
        """Entered ``phase``; ``detail`` is a string, or ``(template, *values)`` that :meth:`_send` formats."""
        # One assignment: the sending thread always reads a whole state.
        self._state = (self._state[0] + 1, phase, detail, startup)
        if startup:
            self.clock.mark_startup(phase)

    def start(self) -> None:
        self._send()
        self._thread.start()

    def stop(self) -> None:
        """No more reports after the last state, which is sent now (the call's final step times)."""
        self._stop.set()
        self._send()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._send()

    def _send(self) -> None:
        count, phase, detail, startup = self._state
        if count == self._sent:
            return
        self._sent = count
        if isinstance(detail, tuple):
            detail = detail[0].format(*detail[1:])
        marks = tuple(self.clock.startup.items())
        report = ProgressReport(self._rank, count, phase, detail, startup, self.clock.snapshot(), marks)
        with contextlib.suppress(Exception):  # the channel is gone once the call is over
            self._queue.actor.put_nowait.remote(report.to_message())


class HeartbeatCallback(*namespaces.every("callbacks.Callback")):
    """Marks every loop event of the Trainer on this rank (added to the worker's Trainer by the worker).

    ``loop_started`` runs as each loop starts (the worker puts its SIGTERM handler back in front of
    the Trainer's there, :class:`ray_lightning.launch.preemption.SigtermFirst`): one callback instead of
    two, since Lightning calls every per-batch hook of every callback, overridden or not, in a profiler
    section of its own. The per-batch marks keep their numbers for :meth:`Heartbeat._send` to format.
    A ``Callback`` of every installed Lightning namespace (:func:`ray_lightning.namespaces.every`).
    """

    def __init__(self, loop_started: Callable[[], None] | None = None, clock: StepClock | None = None) -> None:
        self._loop_started = loop_started
        self._clock = clock if clock is not None else StepClock()
        self._logged: list[float] = []  # the clock's snapshot when the step times were last logged
        self._logged_step = -1

    def _loop_start(self) -> None:
        if self._loop_started is not None:
            self._loop_started()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._clock.mark_startup("process group joined, setup hooks")
        runtime.mark_progress("setup", stage)

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        runtime.mark_progress("sanity check")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loop_start()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.enter(IDLE)  # not a training step's time
        self._loop_start()

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loop_start()

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loop_start()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.enter(DATA)
        runtime.mark_progress("training", ("epoch {} start", trainer.current_epoch))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        clock = self._clock
        clock.enter(COMPUTE)
        if not clock.steps:
            clock.mark_startup("first batch")
        runtime.mark_progress("training", ("epoch {}, batch {}: training_step", trainer.current_epoch, batch_idx))

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        runtime.mark_progress("training", ("epoch {}: backward", trainer.current_epoch))

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.backward_done()
        runtime.mark_progress("training", ("epoch {}: after backward", trainer.current_epoch))

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._clock.enter(OPTIMIZER)
        runtime.mark_progress("training", ("epoch {}: optimizer step", trainer.current_epoch))

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        clock = self._clock
        clock.step_done()
        if clock.steps == 1:
            clock.mark_startup("first step done")
        runtime.mark_progress("training", ("epoch {}, batch {} done", trainer.current_epoch, batch_idx))
        step = trainer.global_step
        if trainer.loggers and step != self._logged_step and step % max(trainer.log_every_n_steps, LOG_EVERY) == 0:
            self._logged_step = step
            log_interval(trainer, self._clock, self._logged)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self._clock.checkpoint_started()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.enter(IDLE)
        runtime.mark_progress("training", ("epoch {} end", trainer.current_epoch))

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        runtime.mark_progress(_loop_name(trainer, "validation"), ("batch {}", batch_idx))

    @override
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kw: Any
    ) -> None:
        runtime.mark_progress(_loop_name(trainer, "validation"), "batch done")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.training:
            self._clock.enter(DATA)  # training goes on with its next batch
        runtime.mark_progress(_loop_name(trainer, "validation"), "end")

    @override
    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        runtime.mark_progress("test", ("batch {}", batch_idx))

    @override
    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kw: Any) -> None:
        runtime.mark_progress("test", "batch done")

    @override
    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        runtime.mark_progress("predict", ("batch {}", batch_idx))

    @override
    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kw: Any) -> None:
        runtime.mark_progress("predict", "batch done")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        runtime.mark_progress("teardown", stage)


def _loop_name(trainer: pl.Trainer, name: str) -> str:
    return "sanity check" if trainer.sanity_checking else name
