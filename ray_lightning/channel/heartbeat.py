"""Each rank's progress during a call, sent to the driver's watchdog (:mod:`ray_lightning.launch.watchdog`).

In a worker, :class:`Heartbeat` keeps a counter of the events the rank passed (the phases before
training, then every batch's start, backward, optimizer step and end in every loop) and the last
one's name. Marking an event is an integer increment and a tuple assignment: nothing is sent from
the training thread. A daemon thread sends the newest state through the driver channel's queue at
most once per interval, and only when it changed, so a rank that stopped still has its last event
delivered, and a rank that trains sends one small message per interval.

:class:`HeartbeatCallback` marks the Lightning loop events; the worker marks the phases before them
(unpickling, ``init_hook``) and the strategies the rendezvous (``runtime.mark_progress``).

Messages are plain tuples, so the queue actor never imports this package.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from ray_lightning import namespaces, runtime

if TYPE_CHECKING:
    import pytorch_lightning as pl

_TAG = "ray_lightning.progress"


@dataclass(frozen=True)
class ProgressReport:
    """The newest progress of one rank: ``count`` events so far, the last in ``phase`` (``detail``: where)."""

    rank: int
    count: int
    phase: str
    detail: str = ""
    startup: bool = True  # a phase before training, bounded by worker_start_timeout_s

    def describe(self) -> str:
        return f"{self.phase} ({self.detail})" if self.detail else self.phase

    def to_message(self) -> tuple:
        return (_TAG, self.rank, self.count, self.phase, self.detail, self.startup)

    @classmethod
    def from_message(cls, message: Any) -> ProgressReport | None:
        """The report a message carries, or None if it is something else (a driver call)."""
        if isinstance(message, tuple) and len(message) == 6 and message[0] == _TAG:
            return cls(*message[1:])
        return None


class Heartbeat:
    """This rank's progress, sent to the driver every ``interval_s`` while it changes."""

    def __init__(self, rank: int, queue: Any, interval_s: float) -> None:
        self._rank = rank
        self._queue = queue
        self._interval_s = interval_s
        self._state = (1, "starting the call", "", True)
        self._sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ray_lightning-heartbeat", daemon=True)

    def mark(self, phase: str, detail: str = "", startup: bool = False) -> None:
        # One assignment: the sending thread always reads a whole state.
        self._state = (self._state[0] + 1, phase, detail, startup)

    def start(self) -> None:
        self._send()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._send()

    def _send(self) -> None:
        count, phase, detail, startup = self._state
        if count == self._sent:
            return
        self._sent = count
        report = ProgressReport(self._rank, count, phase, detail, startup)
        with contextlib.suppress(Exception):  # the channel is gone once the call is over
            self._queue.actor.put_nowait.remote(report.to_message())


class HeartbeatCallback(*namespaces.every("callbacks.Callback")):
    """Marks every loop event of the Trainer on this rank (added to the worker's Trainer by the worker).

    A ``Callback`` of every installed Lightning namespace (:func:`ray_lightning.namespaces.every`).
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        runtime.mark_progress("setup", stage)

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        runtime.mark_progress("sanity check")

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        runtime.mark_progress("training", f"epoch {trainer.current_epoch} start")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        runtime.mark_progress("training", f"epoch {trainer.current_epoch}, batch {batch_idx}: training_step")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        runtime.mark_progress("training", f"epoch {trainer.current_epoch}: backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        runtime.mark_progress("training", f"epoch {trainer.current_epoch}: after backward")

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        runtime.mark_progress("training", f"epoch {trainer.current_epoch}: optimizer step")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        runtime.mark_progress("training", f"epoch {trainer.current_epoch}, batch {batch_idx} done")

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        runtime.mark_progress("training", f"epoch {trainer.current_epoch} end")

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        runtime.mark_progress(_loop_name(trainer, "validation"), f"batch {batch_idx}")

    @override
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kw: Any
    ) -> None:
        runtime.mark_progress(_loop_name(trainer, "validation"), "batch done")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        runtime.mark_progress(_loop_name(trainer, "validation"), "end")

    @override
    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        runtime.mark_progress("test", f"batch {batch_idx}")

    @override
    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kw: Any) -> None:
        runtime.mark_progress("test", "batch done")

    @override
    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        runtime.mark_progress("predict", f"batch {batch_idx}")

    @override
    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kw: Any) -> None:
        runtime.mark_progress("predict", "batch done")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        runtime.mark_progress("teardown", stage)


def _loop_name(trainer: pl.Trainer, name: str) -> str:
    return "sanity check" if trainer.sanity_checking else name
