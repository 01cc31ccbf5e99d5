"""Recovery checkpoints: what a fit that may restart its workers resumes from.

When ``max_failures > 0``, the ranks write a Lightning checkpoint (what ``trainer.save_checkpoint``
writes: weights, optimizers, schedulers, loops, callbacks) at every epoch boundary, every
``recovery_checkpoint_every_n_steps`` optimizer steps if set, and at once when a worker's process or
node is about to go away (:mod:`ray_lightning.launch.preemption`). They write it where a restart reads
it: the run's folder with ``storage_path`` (:mod:`.storage`), else a private folder on the driver's
machine (:mod:`.driver_disk`): no shared filesystem is needed, the checkpoint survives rank 0's node,
and no process holds it whole that did not already (a sharded strategy's ranks each write their own
shards; DDP's rank 0 the one file). The driver learns where the newest complete one is
(:mod:`ray_lightning.launch.recovery`).

Decisions:

* The epoch's checkpoint is taken in ``on_train_epoch_end``, after every other callback's (it is a
  ``Checkpoint``, which Lightning calls after the others, and it moves itself to the end of the
  list): the state a ``ModelCheckpoint(save_on_train_epoch_end=True)`` file has, from which
  Lightning resumes at the next epoch exactly (the same batches, and the same weights for a
  deterministic module: checked from Lightning 2.4 to 2.6). The next epoch's start would not do:
  Lightning 2.6 takes a checkpoint from there as a finished epoch and skips it.
* Under Horovod rank 0 alone takes it: every rank holds the same weights and optimizer state, and nothing
  here waits for the other ranks. Under DDP (:mod:`.spread`) and a sharded strategy (their
  ``collective_checkpoints``) every rank takes part: DDP's each writing a part of the state they all hold, a
  sharded strategy's each its own shards (``strategy.checkpoint_to_storage``; FSDP1 and DeepSpeed gather on
  rank 0). Whether a preemption asks for one is agreed by all ranks (a one-number all-reduce: a notice reaches
  one rank alone) about once per :data:`AGREE_EVERY_S` of training, not at every step: a host-device
  synchronization per step would cost GPUs their lead. The ranks count batches alike, so they agree at the
  same batch: after :data:`CALIBRATION_BATCHES` batches (agreed at each), rank 0's batch time sets the interval,
  broadcast once.
  A notice then waits at most about a second for its checkpoint (a spot notice gives 30 s or more).
* Lightning's checkpoints hold no random generator state: rank 0 sends its generators' states as
  the first step after a checkpoint starts, and a restarted fit sets them on every rank at its
  first step (:class:`RestoreRandomStates`), so dropout draws the masks it would have drawn.
* No step checkpoint on an epoch's last batch (Lightning would skip that epoch's end on resume):
  the epoch's own checkpoint follows a moment later.
* Nothing of a checkpoint passes through the driver's process: the ranks write it (:func:`write_checkpoint`)
  while training goes on, rank 0 writes the marker that makes it complete and tells the driver where it is.
* With each checkpoint, a rank 0 that writes into a staging directory (off the driver's machine)
  also sends what it wrote or removed there since the last one (:class:`~.files.StagingMirror`):
  the checkpoint files of finished epochs reach the driver even if rank 0's node is lost.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from typing_extensions import override

from ray_lightning import _lightning, namespaces, runtime
from ray_lightning.channel.driver_channel import send_object_to_driver
from ray_lightning.home import spread, storage
from ray_lightning.home.files import StagingMirror

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)

# A sharded fit's ranks agree whether a preemption notice asks for a checkpoint about this often (see above).
AGREE_EVERY_S = 1.0
CALIBRATION_BATCHES = 8
MAX_AGREE_EVERY = 1000  # batches: a bound however fast the steps

EPOCH = "epoch boundary"
PREEMPTION = "preemption"  # a checkpoint's reason starts with it when a notice asked for the checkpoint


class RecoveryCheckpoints(*namespaces.every("callbacks.Checkpoint")):
    """Sends recovery checkpoints to the driver: added to rank 0's Trainer by the worker.

    A ``Checkpoint`` callback of every installed Lightning namespace (:func:`ray_lightning.namespaces.every`).
    """

    def __init__(
        self,
        every_n_steps: int | None,
        mirror: StagingMirror | None,
        collective: bool = False,
        storage_run: storage.Run | None = None,
        call_tag: str = "",
    ) -> None:
        self._every_n_steps = every_n_steps
        self._collective = collective
        self._storage_run = storage_run
        self._call_tag = call_tag  # the call and attempt: with a count, the folder of each checkpoint in storage
        self._taken = 0
        self._mirror = mirror  # what a staged rank 0 wrote goes home with each checkpoint
        self._last_step = -1  # the step of the newest checkpoint sent
        self._request: str | None = None  # why a checkpoint was asked for, until it is taken
        self._pending: str | None = None  # a sharded fit's: asked of this rank, until the ranks agree on it
        self._random_states_due = False
        self._batches = 0  # this fit's batches on this rank: the same count on every rank
        self._agree_every = 1  # batches between the ranks' agreements on a preemption (collective only)
        self._calibration_started: float | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # After the callbacks the module configured (Lightning puts checkpoint callbacks last): its
        # checkpoint then holds what every other callback did at the epoch's end.
        trainer.callbacks.remove(self)
        trainer.callbacks.append(self)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The step the fit starts at (0, or a resumed one) is not a step's checkpoint: with accumulate_grad_batches,
        # one after its first micro-batch would hold a position past samples whose gradients it does not hold.
        self._last_step = trainer.global_step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._random_states_due and trainer.is_global_zero:
            # The random generators as the first step after the checkpoint finds them (dropout's
            # masks, random augmentation): restored there, the resumed run draws the same numbers.
            self._random_states_due = False
            send_object_to_driver({"random_states_for": self._last_step}, random_states())

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        request = runtime.take_checkpoint_request()
        if not self._collective:
            self._request = _join(self._request, request)
        else:
            # Held until the ranks agree: a rank that checkpointed alone would wait for the others forever.
            self._pending = _join(self._pending, request)
            asked = self._pending is not None
            if self._agree_now(trainer) and trainer.strategy.reduce_boolean_decision(asked, all=False):
                self._request = self._pending or "another rank's worker is going away"
        if _lightning.is_last_batch(trainer):
            return  # Lightning skips the epoch's end when resuming from its last batch; the epoch's checkpoint follows
        step = trainer.global_step
        due = self._every_n_steps is not None and step % self._every_n_steps == 0 and step != self._last_step
        if self._request is not None:
            self._send(trainer, f"{PREEMPTION}: {self._request}", preemption=True)
        elif due:
            self._send(trainer, f"every {self._every_n_steps} steps")

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Every rank takes the epoch's checkpoint: one asked for and not yet agreed is this one (rank 0 says why).
        self._request = _join(self._request, self._pending)
        if self._request is not None:
            self._send(trainer, f"{PREEMPTION}: {self._request}", preemption=True)
        else:
            self._send(trainer, EPOCH)

    def _agree_now(self, trainer: pl.Trainer) -> bool:
        """Whether the ranks agree on a preemption at this batch: at each of the first batches, then about every
        :data:`AGREE_EVERY_S` (the interval rank 0 measured, broadcast once: every rank uses the same)."""
        self._batches += 1
        if self._batches == 1:
            self._calibration_started = time.perf_counter()
        elif self._batches == CALIBRATION_BATCHES + 1:
            assert self._calibration_started is not None
            seconds = (time.perf_counter() - self._calibration_started) / CALIBRATION_BATCHES
            every = max(1, min(MAX_AGREE_EVERY, int(AGREE_EVERY_S / max(seconds, 1e-6))))
            self._agree_every = int(trainer.strategy.broadcast(every, src=0))
        return self._batches <= CALIBRATION_BATCHES or self._batches % self._agree_every == 0

    def _send(self, trainer: pl.Trainer, reason: str, preemption: bool = False) -> None:
        self._last_step, self._request, self._pending = trainer.global_step, None, None
        started = time.perf_counter()
        runtime.mark_progress("training", f"recovery checkpoint ({reason})")
        self._to_storage(trainer, self._header(trainer, reason, preemption), started)

    @staticmethod
    def _header(trainer: pl.Trainer, reason: str, preemption: bool) -> dict[str, Any]:
        return {
            # The epoch the workers resume in: the next one after an epoch's end.
            "epoch": trainer.current_epoch + (1 if reason == EPOCH else 0),
            "global_step": trainer.global_step,
            # The step the loggers log at (a CSV log a restarted rank 0 continues keeps the rows before it).
            "log_step": _lightning.fit_progress_state(trainer)["batches_that_stepped"],
            "reason": reason,
            "preemption": preemption,
            "world_size": trainer.world_size,
        }

    def _to_storage(self, trainer: pl.Trainer, header: dict[str, Any], started: float) -> None:
        """Every rank that holds part of the state writes it into a new folder of the run (the storage path's, or
        the driver's machine's: :mod:`.driver_disk`); rank 0, once all parts are written, the marker, and tells the
        driver, with the files a staged rank 0 changed (in the background: training goes on meanwhile)."""
        run = self._storage_run
        assert run is not None, "recovery checkpoints go to storage_path or to the driver's recovery folder"
        self._taken += 1
        folder = run.recovery_folder(trainer.global_step, f"{self._call_tag}-{self._taken}")
        rank_zero = trainer.is_global_zero
        # Read on the training thread: what the epochs wrote so far, as the checkpoint has it.
        changes = self._mirror.changes() if self._mirror is not None and rank_zero else None

        uploads = storage.uploads()

        def complete(resume_from: str) -> None:
            if not rank_zero or uploads.abandoned:
                return  # an attempt that failed: a restart may be reading the checkpoint this one would replace
            done = {**header, "folder": folder, "resume_from": resume_from, "written_at": time.time()}
            done["seconds"] = done["written_at"] - wall_started
            storage.write_marker(folder, done)
            storage.remove_older_recovery(run, keep=folder)
            mirror = self._mirror
            sent = {"files": mirror.send(changes[0]), "removed": changes[1]} if mirror and changes else None
            send_object_to_driver(done, sent)

        wall_started = time.time()
        if spread.applies(trainer):  # DDP: every rank writes a part of the state it holds alike
            spread.write(trainer, folder, complete)
        else:
            write_checkpoint(trainer, folder, storage.CHECKPOINT_FILE, complete)
        blocked = time.perf_counter() - started
        if rank_zero:
            log.debug("ray_lightning: recovery checkpoint into %s; training waited %.3f s", folder, blocked)
        self._random_states_due = True


def write_checkpoint(trainer: pl.Trainer, folder: str, filename: str | None, complete: Any = None) -> str:
    """In every rank: the Trainer's checkpoint into storage, written by the ranks in the background
    (:func:`storage.uploads`); returns what ``ckpt_path`` resumes from. ``complete(that)`` runs in rank 0 once
    every rank's part is written.

    A sharded strategy's ranks each write their own shards into ``folder`` (torch's distributed checkpoint); the
    others' rank 0 writes one file, ``folder/filename`` (``folder`` itself when ``filename`` is None). Growth
    law: each rank writes and holds in memory at most its own part; nothing passes through another process.
    """
    write = getattr(trainer.strategy, "checkpoint_to_storage", None)  # each rank its shard (sharded strategies)
    if write is not None:
        write(trainer, folder, complete or (lambda _: None))
        return folder
    target = folder if filename is None else storage.join(folder, filename)
    _upload_full_checkpoint(trainer, target, complete or (lambda _: None))
    return target


def _upload_full_checkpoint(trainer: pl.Trainer, target: str, complete: Any) -> None:
    """Rank 0 uploads the full checkpoint (every rank's state is the same; FSDP1's is gathered on rank 0 first)."""
    take = getattr(trainer.strategy, "full_checkpoint", None)
    checkpoint = take(trainer) if take is not None else _lightning.dump_checkpoint(trainer)
    if not trainer.is_global_zero:
        return

    def start() -> Any:
        copy = storage.snapshot(checkpoint)  # taken before training goes on; serialized and written beside it

        def job() -> None:
            storage.save_checkpoint(target, copy)
            complete(target)

        return job

    storage.uploads().submit(target, start)


class RestoreRandomStates(*namespaces.every("callbacks.Callback")):
    """In every rank of a restarted fit: the random generators as they were after the checkpoint, at the first step.

    Lightning's checkpoints hold no random state. Every rank gets rank 0's, which is every rank's
    when the ranks are seeded alike (``seed_everything``, as Lightning re-seeds every rank).
    """

    def __init__(self, states: dict[str, Any]) -> None:
        self._states: dict[str, Any] | None = states

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._states is not None:
            set_random_states(self._states)
            self._states = None


def random_states() -> dict[str, Any]:
    """This process's Python, numpy, torch (and CUDA) random generator states."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_random_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available() and torch.cuda.device_count() == len(states["cuda"]):
        torch.cuda.set_rng_state_all(states["cuda"])


def _join(first: str | None, second: str | None) -> str | None:
    return "; ".join(r for r in (first, second) if r) or None
