"""Restarts inside one call (``max_failures``): the driver's memory across a call's attempts.

The launcher runs a call's attempts (:meth:`ray_lightning.launch.launcher.RayLauncher.launch`);
whether a failure is followed by a restart is decided in :mod:`.failures`. :class:`Recovery` keeps
what the attempts share: where the newest complete recovery checkpoint is (:mod:`ray_lightning.home.recovery`):
in the run's folder with ``storage_path`` (:mod:`ray_lightning.home.storage`), else in a private folder on the
driver's machine that the ranks write and read in chunks (:mod:`ray_lightning.home.driver_disk`; no byte of it
passes through this process); the files a staged rank 0 mirrored here, a preemption rank 0 checkpointed for, and
each restart, logged and recorded (``trainer.strategy.restarts``).

Decisions:

* The workers resume from the newest recovery checkpoint with Lightning's own ``fit(ckpt_path=...)``,
  so weights, optimizers, schedulers, loops and callbacks continue where it was taken; before the
  first one, from the call's own ``ckpt_path`` (or the start).
* When a call runs out of restarts, the last failure is raised with every earlier one's message
  (``RayWorkerError.failures``).
"""

from __future__ import annotations

import copy
import logging
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import ray

from ray_lightning.config.elastic import ElasticSettings
from ray_lightning.config.restarts import RecoverySettings
from ray_lightning.errors import RayWorkerError, WorkerPreemptedError
from ray_lightning.home import driver_disk, files, landing, storage
from ray_lightning.home.outbox import Outbox
from ray_lightning.home.recovery import PREEMPTION
from ray_lightning.launch import memory
from ray_lightning.launch.actor import NodeInfo
from ray_lightning.launch.failures import RESIZES, Failure, Kind
from ray_lightning.launch.preemption import forget_notice
from ray_lightning.runtime import CheckpointFile, RecoveryPlan

log = logging.getLogger(__name__)

# Bound on reading a recovery checkpoint rank 0 sent (it travels between nodes once).
FETCH_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Restart:
    """One restart of a call's workers, as ``trainer.strategy.restarts`` lists them.

    ``rank`` failed on ``node`` (its IP) because of ``cause`` (the error's first line); the new
    workers resumed in ``epoch`` after ``global_step`` optimizer steps, from ``source``: ``"memory"`` (the
    survivors' state at the failure, :mod:`.memory`) or ``"checkpoint"`` (the newest recovery checkpoint; both
    None and ``source`` None: from the call's start). ``steps_lost``: optimizer steps the survivors had completed
    beyond that point, trained again (None: unknown). ``failed_at``: when the driver learned of it
    (``time.time()``); ``reason``: why a restart could fix it. ``spares``: workers replaced by a spare process
    that had started before the failure (no new process's start was waited for).
    """

    number: int
    rank: int
    node: str | None
    cause: str
    epoch: int | None
    global_step: int | None
    failed_at: float
    reason: str
    world_size: int | None = None
    source: str | None = None
    steps_lost: int | None = None
    spares: int = 0

    @property
    def resize(self) -> bool:
        """Whether this restart was a resize (growing), not a failure."""
        return self.reason == Kind.GROW.value


@dataclass(frozen=True)
class _Checkpoint:
    path: str
    epoch: int
    global_step: int
    log_step: int
    reason: str


class Recovery:
    """The driver's side of one call's attempts, and of its restarts (``settings.max_failures`` of them at most)."""

    def __init__(
        self,
        settings: RecoverySettings,
        scope: landing.WriteScope,
        history: list[Restart],
        run: storage.Run | None = None,
        elastic: ElasticSettings | None = None,
        from_memory: bool = False,
    ) -> None:
        self.settings = settings
        # A replicated fit's restart after a worker died goes on from the survivors' state (launch.memory).
        self.from_memory = from_memory
        self._memory: memory.InMemory | None = None
        self.elastic = elastic  # num_workers=(min, max): it grows at recovery checkpoints, so it takes them
        self.run = run  # with storage_path: the checkpoints are in the run's folder, never on this machine
        self._home: storage.Run | None = None  # without: the call's folder on this machine (home.driver_disk)
        self._random_states: dict[int, Any] = {}  # rank 0's generators after the checkpoint of each step
        self.restarts: list[Restart] = []  # this call's
        self._history = history  # every call's: ``trainer.strategy.restarts``
        self._scope = scope
        self._failures: list[str] = []
        self._latest: _Checkpoint | None = None
        self._going_away: dict[str, Any] | None = None  # the header of a preemption checkpoint, until acted on
        self._call_id = uuid.uuid4().hex
        self._synced: set[str] = set()  # files a staged rank 0 wrote that are on this machine now
        self.started = time.time()

    @property
    def notice_key(self) -> str:
        """Where this attempt's workers leave word that one of them is going away (Ray's key-value store): one key
        per attempt, so a notice a worker of an earlier attempt left does not move the next attempt's workers."""
        return self._notice_key(len(self.restarts))

    def _notice_key(self, attempt: int) -> str:
        return f"notice-{attempt}-{self._call_id}"  # the call's id last: storage folders are named by its end

    @property
    def enabled(self) -> bool:
        """Whether the call may restart its workers (``max_failures > 0``)."""
        return self.settings.enabled

    @property
    def takes_checkpoints(self) -> bool:
        """Whether the ranks take recovery checkpoints: for restarts, and with storage_path for a run that
        outlives its driver (:meth:`resume_from_storage`)."""
        return self.settings.enabled or self.run is not None or self.elastic is not None

    @property
    def latest(self) -> _Checkpoint | None:
        """The newest recovery checkpoint (``epoch``, ``global_step``, ``reason``), None before the first."""
        return self._latest

    @property
    def failures_restarted(self) -> int:
        """The restarts that followed failures (what ``max_failures`` bounds): resizes do not count."""
        return sum(not r.resize for r in self.restarts)

    @property
    def synced(self) -> frozenset[str]:
        """The files of a staged rank 0 that reached this machine during the call (:meth:`mirror`)."""
        return frozenset(self._synced)

    @property
    def checkpoint_run(self) -> storage.Run | None:
        """Where the ranks write the recovery checkpoints: the run's folder (``storage_path``), else this call's
        folder on the driver's machine; None before the first attempt's plan."""
        return self.run or self._home

    def plan(self, infos: Iterable[NodeInfo], fitting: bool = True) -> RecoveryPlan | None:
        """What the workers of the next attempt do for recovery (None: nothing); ``fitting``: a Trainer's fit,
        whose ranks write recovery checkpoints (a folder on this machine is made for them without storage_path)."""
        if not self.takes_checkpoints:
            return None
        if self.checkpoint_run is None and fitting:
            folder = f"call-{self._call_id}"
            self._home = storage.Run(driver_disk.run_url(folder), folder)
        nodes = tuple(dict.fromkeys(info.node_id for info in infos))
        latest = self._latest if self.restarts else None
        log_step = latest.log_step if latest is not None else None
        random_states = self._random_states.get(latest.global_step) if latest is not None else None
        if self._memory is not None:
            log_step, random_states = self._memory.header.log_step, self._memory.header.random_states
        return RecoveryPlan(
            self.settings.every_n_steps,
            self.notice_key,
            nodes,
            attempt=len(self.restarts),
            log_step=log_step,
            random_states=random_states,
            storage_run=self.checkpoint_run,
            elastic=(
                (self.elastic.min_workers, self.elastic.max_workers, self.elastic.batch_policy)
                if self.elastic is not None
                else None
            ),
            from_memory=self.from_memory and fitting,
        )

    def resume_from_storage(self, entry: storage.RecoveryEntry) -> None:
        """A new driver of a run found ``entry`` in its folder: the call starts from there."""
        self._latest = _checkpoint_in_storage(entry.header)

    def receive(self, header: dict[str, Any], ref: ray.ObjectRef) -> None:
        """Word from rank 0 (the driver channel's ``on_object``): a recovery checkpoint is complete (where it is,
        and the files a staged rank 0 changed since the last one), or its random states after one."""
        try:
            value = ray.get(ref, timeout=FETCH_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - rank 0 died while sending: keep the one before
            log.warning("ray_lightning: could not read the recovery checkpoint rank 0 sent: %s", error)
            return
        if "random_states_for" in header:
            # Kept by step: with storage, the checkpoint's own word may come after them.
            self._random_states = {header["random_states_for"]: value}
            return
        self._latest = _checkpoint_in_storage(header)
        if self._memory is not None and self._latest.global_step >= self._memory.header.global_step:
            self._memory = None  # read by the restarted ranks long ago: its copy leaves the source's object store
        if value is not None:
            self.mirror(landing.write(value["files"], self._scope), landing.remove(value["removed"], self._scope))
        log.debug("ray_lightning: recovery checkpoint at epoch %s, step %s in %s", *_where(header))
        if header.get("preemption"):
            self._going_away = header

    def mirror(self, written: Iterable[str], removed: Iterable[str] = ()) -> None:
        """Files of a staged rank 0 that were written on (or removed from) this machine: the one record of them."""
        self._synced.update(written)
        self._synced.difference_update(removed)

    def stop_for_preemption(self) -> WorkerPreemptedError | None:
        """Once rank 0 took a checkpoint because a worker is going away: the error that ends the attempt at once,
        when a restart may follow (else the attempt goes on until the worker is gone)."""
        header, self._going_away = self._going_away, None
        if header is None or self.failures_restarted >= self.settings.max_failures:
            return None
        reason = header["reason"].removeprefix(f"{PREEMPTION}: ")
        return WorkerPreemptedError(
            f"ray_lightning: {reason}; rank 0 took a recovery checkpoint at epoch {header['epoch']}, "
            f"step {header['global_step']}, and the workers move.",
            rank=0,
            reason=reason,
        )

    @property
    def memory_file(self) -> CheckpointFile | None:
        """The survivors' state the next attempt goes on from (:mod:`.memory`), when a restart took one."""
        return self._memory.file if self._memory is not None else None

    def checkpoint(self, given: str | None) -> str | None:
        """The ``ckpt_path`` file the next attempt resumes from: the newest recovery checkpoint, else ``given``."""
        return self._latest.path if self._latest is not None else given

    def record_restart(
        self, failure: Failure, world_size: int | None = None, survivors: Iterable[Any] = (), spares: int = 0
    ) -> Restart:
        """Log and record the restart that follows ``failure`` (:func:`~.failures.decide` chose it) on
        ``world_size`` workers; ``survivors``: the actors it keeps, whose state it may go on from; ``spares``: the
        spare processes that took dead workers' places."""
        failed_at = failure.at  # not now: the salvage or the new placement came in between
        if self.checkpoint_run is not None:
            # Rank 0 may have completed a checkpoint and died before its word reached this process.
            found = storage.newest_complete(self.checkpoint_run)
            if found is not None and (self._latest is None or found.header["global_step"] >= self._latest.global_step):
                self._latest = _checkpoint_in_storage(found.header)
        latest, reached, self._memory = self._latest, None, None
        if self.from_memory and survivors:
            newer_than = latest.global_step if latest is not None else None
            self._memory, reached = memory.take(list(survivors), len(self.restarts), newer_than)
        point: Any = self._memory.header if self._memory is not None else latest
        source = "memory" if self._memory is not None else "checkpoint" if latest is not None else None
        restart = Restart(
            number=len(self.restarts) + 1,
            rank=failure.rank,
            node=failure.node.node_ip if failure.node is not None else None,
            cause=_first_line(failure.error),
            epoch=point.epoch if point else None,
            global_step=point.global_step if point else None,
            failed_at=failed_at,
            reason=failure.kind.value,
            world_size=world_size,
            source=source,
            steps_lost=reached - point.global_step if reached is not None and point is not None else None,
            spares=spares,
        )
        self.restarts.append(restart)
        self._history.append(restart)
        resumed = f"from epoch {restart.epoch} after step {restart.global_step}" if point else "from the start"
        if source == "memory":
            resumed += " (the survivors' state in memory)"
        if spares:
            resumed += f", {spares} spare process(es) in the dead workers' places"
        if failure.kind in RESIZES:
            log.warning("ray_lightning: %s workers now; the call goes on %s.", world_size, resumed)
            return restart
        self._failures.append(str(failure.error))
        on = f" on {world_size} workers" if world_size is not None else ""
        log.warning(
            "ray_lightning: restarting the workers (%d of max_failures=%d) after rank %d on node %s: %s (%s); "
            "running the call again%s %s.",
            self.failures_restarted,
            self.settings.max_failures,
            restart.rank,
            restart.node or "?",
            restart.cause,
            restart.reason,
            on,
            resumed,
        )
        return restart

    def final_error(self, error: BaseException) -> BaseException:
        """``error``, with the earlier failures' messages when the call had restarted before."""
        if not self._failures:
            return error
        if not isinstance(error, RayWorkerError):
            error.args = (f"{error} (while restarting; earlier: {' | '.join(map(_first_line_of, self._failures))})",)
            return error
        earlier = "\n".join(f"--- failure {i} (restart {i}) ---\n{text}" for i, text in enumerate(self._failures, 1))
        final = copy.copy(error)
        limit = f"max_failures={self.settings.max_failures}"
        final.args = (
            f"ray_lightning: the call failed {len(self._failures) + 1} times ({limit}); the last failure:\n"
            f"{error}\nEarlier failures, each followed by a restart:\n{earlier}",
        )
        final.failures = list(self._failures)
        final.__cause__ = error.__cause__
        return final

    def seed_files(self, directories: Iterable[str], home: str | None = None) -> dict[str, Any]:
        """What this call wrote on the driver's side so far: a new staged rank 0 starts from it (large files copied
        into the driver's folder ``home``, which rank 0 reads in chunks: :class:`~ray_lightning.home.outbox.Outbox`)."""
        outbox = Outbox(home)
        seeds = files.recent(directories, self.started, outbox)
        for path in self._synced:
            if path not in seeds and os.path.isfile(path):
                seeds[path] = outbox.take(path)
        return seeds

    def close(self) -> None:
        """After the call: remove the recovery checkpoints on this machine and the notice key."""
        self._memory = None
        if self._home is not None:
            try:
                storage.remove(self._home.url)
            except Exception as error:  # noqa: BLE001 - Ray is gone (its temp folder with it), or the server is
                log.debug("ray_lightning: could not remove the recovery folder %s: %s", self._home.url, error)
            self._home = None
        if self.takes_checkpoints:
            for attempt in range(len(self.restarts) + 1):
                forget_notice(self._notice_key(attempt))


def _checkpoint_in_storage(header: dict[str, Any]) -> _Checkpoint:
    fields = ("resume_from", "epoch", "global_step", "log_step", "reason")
    return _Checkpoint(*(header[name] for name in fields))


def _where(header: dict[str, Any]) -> tuple[Any, ...]:
    return header["epoch"], header["global_step"], header["folder"]


def _first_line(error: BaseException) -> str:
    return _first_line_of(str(error)) or type(error).__name__


def _first_line_of(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""
