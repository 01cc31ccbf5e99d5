"""A replicated fit's state in each rank's memory: what a restart goes on from after a peer died mid-step.

Under DDP and Horovod every rank holds the whole state (weights, optimizer, schedulers, loops). When a
peer dies, the collective of the step in flight fails in the survivors before any of them stepped its
optimizer, so each survivor still holds the state after the last completed step. :class:`MemorySnapshot`
(a callback on every rank of a fit that may restart, ``from_memory`` in its recovery plan) keeps a
reference to that state when the fit fails inside a training batch; the driver then asks the survivors
which step they hold (:func:`header`), has the one furthest on serialize it into its own node's object
store (:func:`share`), and the restarted ranks read it from there as their ``ckpt_path``
(:mod:`ray_lightning.launch.memory`).

Decisions:

* The reference is taken where the worker sees the fit fail (:func:`keep_after_failure`), before anything is torn
  down (a worker runs the Trainer's ``_fit_impl``, not ``fit``: Lightning's ``on_exception`` hooks do not run
  there, as in its own spawned processes), and nothing is copied then:
  nothing trains in this process until the driver's next call, and the next call lets it go first
  (:func:`forget`), before it builds its model. Only the survivor chosen as the source serializes.
* Only a failure inside a training batch counts (from ``on_train_batch_start`` to its end, where
  Lightning's loops resume exactly as from a step checkpoint); a failure in validation, at an epoch's
  end or in set-up leaves no snapshot, and the restart reads the newest recovery checkpoint as before.
* With ``accumulate_grad_batches``, the batches accumulated since the last optimizer step are trained again
  (their gradients were in the step that failed).
* Lightning's checkpoints hold no random state: the generators as the failed batch began are kept with
  it (a few KiB, read at the start of each step's first batch), so the resumed batch draws what it would have
  drawn.

Growth law: at a failure each survivor holds its own state, referenced (no copy); the source adds one
serialized copy (the state's size) to its node's object store; each other rank reads it once from there.
Nothing passes through the driver's process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from typing_extensions import override

from ray_lightning import _lightning, namespaces
from ray_lightning.home import storage
from ray_lightning.home.recovery import random_states

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapshotHeader:
    """What a survivor holds: the attempt it trained in, the optimizer steps it completed before the failure, and
    where its state is (``epoch`` None: it holds no state, only the step it reached)."""

    attempt: int
    global_step: int
    epoch: int | None = None
    log_step: int | None = None
    random_states: Any = None

    @property
    def held(self) -> bool:
        """Whether the survivor holds its state (the fit failed inside a training batch)."""
        return self.epoch is not None


_held: tuple[SnapshotHeader, dict[str, Any] | None] | None = None


class CallInterrupted(RuntimeError):
    """Raised in every rank at a training batch's start once the driver cancelled the call (``ray.cancel``): the fit
    leaves it as after a peer's death, each rank's state at its last completed step kept for the next call."""


def _interrupted() -> bool:
    """Whether the driver cancelled the call this process runs (a flag Ray sets; read per batch, a few µs)."""
    try:
        return ray.get_runtime_context().is_canceled()
    except RuntimeError:  # not in a Ray worker's task (a Trainer in a test's own process)
        return False


def leave_if_interrupted(trainer: pl.Trainer) -> None:
    """Raise :class:`CallInterrupted` if the driver ended the call (an elastic fit grows in its running processes)."""
    if _interrupted():
        raise CallInterrupted(f"ray_lightning: the driver interrupted this fit at step {trainer.global_step}")


class LeavesWhenInterrupted(*namespaces.every("callbacks.Callback")):
    """On every rank of an elastic fit that goes on from checkpoints (sharded): leaves the call at a training batch's
    start once the driver cancelled it, as :class:`MemorySnapshot` does for a replicated fit; the fit then goes on
    from the newest checkpoint in these processes."""

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        leave_if_interrupted(trainer)


class MemorySnapshot(*namespaces.every("callbacks.Callback")):
    """On every rank of a replicated fit that may restart: keeps its state when the fit fails inside a training
    batch (see the module docstring)."""

    def __init__(self, attempt: int) -> None:
        self.attempt = attempt
        self._in_batch = False
        self._random_states: Any = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._in_batch = True
        if _lightning.batches_processed(trainer) % max(1, trainer.accumulate_grad_batches) == 0:
            self._random_states = random_states()  # where a resumed run starts: the first batch of a step
        leave_if_interrupted(trainer)  # state kept

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._in_batch = False

    def keep(self, trainer: pl.Trainer) -> None:
        """The fit failed: keep its state if the failure was inside a training batch, else only the step reached."""
        global _held
        step = trainer.global_step
        if not self._in_batch:  # validation, an epoch's end, set-up: between training batches
            _held = (SnapshotHeader(self.attempt, step), None)
            return
        # The position after the last completed step (this rank's Trainer of the failed fit, which ends here).
        _lightning.settle_failed_batch(trainer)
        header = SnapshotHeader(
            self.attempt,
            step,
            epoch=trainer.current_epoch,
            log_step=_lightning.fit_progress_state(trainer)["batches_that_stepped"],
            random_states=self._random_states,
        )
        _held = (header, _lightning.dump_checkpoint(trainer))


def keep_after_failure(trainer: pl.Trainer) -> None:
    """In a worker whose fit raised: keep what a restart may go on from, if this fit keeps snapshots. Never raises:
    the fit's own error is what the driver must see (a state that could not be taken leaves only the step)."""
    global _held
    for callback in trainer.callbacks:
        if isinstance(callback, MemorySnapshot):
            try:
                callback.keep(trainer)
            except Exception as error:  # noqa: BLE001 - a hook of the checkpoint failed: the restart reads one
                log.warning("ray_lightning: this rank's state could not be kept for the restart: %r", error)
                _held = (SnapshotHeader(callback.attempt, trainer.global_step), None)


def header() -> SnapshotHeader | None:
    """What this process holds since its last fit failed (None: it did not fail in a fit that keeps snapshots)."""
    return _held[0] if _held is not None else None


def share() -> list[ray.ObjectRef]:
    """The held state serialized (``torch.save``'s format) into this node's object store: ``[reference]``, a list
    so that Ray hands the caller the reference, not the bytes. This process owns it: it must live until the
    restarted ranks have read it (the source is a survivor, which the restart runs on)."""
    global _held
    assert _held is not None and _held[1] is not None, "share() after a failure that left a snapshot"
    reference = ray.put(bytes(storage.serialize(_held[1])))
    _held = (_held[0], None)  # the state itself is no longer needed here
    return [reference]


def forget() -> None:
    """Let the held state go (the next call in this process starts)."""
    global _held
    _held = None


def file_name(global_step: int) -> str:
    """The name the restarted ranks give the state they read (it shows in Lightning's "Restoring states" line)."""
    return f"ray_lightning-memory-step={global_step}.ckpt"
