"""A call on the driver: what it keeps across its attempts (:class:`DriverCall`), what one attempt returns
(:class:`Attempt`), and what is read off them (where rank 0 stages, what ends an attempt early, whether the workers
keep the fit).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from ray_lightning import namespaces
from ray_lightning.channel.worker_output import output_sync
from ray_lightning.errors import RayWorkerError
from ray_lightning.home import files, landing, storage
from ray_lightning.home.results import WorkerOutput
from ray_lightning.launch.actor import NodeInfo
from ray_lightning.launch.contexts import CallSettings, node_staging_name
from ray_lightning.launch.elastic import Growth
from ray_lightning.launch.failures import Failure
from ray_lightning.launch.payload import checkpoint_files
from ray_lightning.launch.recovery import Recovery
from ray_lightning.launch.session import driver_node_id
from ray_lightning.launch.watchdog import Watchdog
from ray_lightning.launch.worker_group import WorkerGroup
from ray_lightning.runtime import CheckpointFile

if TYPE_CHECKING:
    import pytorch_lightning as pl


@dataclass(frozen=True)
class Attempt:
    """One run of a call on one worker group: its outputs (actor order), or the failure that ended it.

    ``nodes``: where each global rank ran; ``staging``: where rank 0 wrote its files, when it ran off
    the driver's machine.
    """

    group: WorkerGroup
    outputs: list[WorkerOutput | None] | None = None
    nodes: Mapping[int, NodeInfo] = field(default_factory=dict)
    staging: files.StagingArea | None = None
    failure: Failure | None = None
    watchdog: Watchdog | None = None  # what the ranks reported: their step times and start-up


@dataclass
class DriverCall:
    """What one ``fit``/``test``/... keeps on the driver across its attempts (never sent to the workers)."""

    payload: ray.ObjectRef
    checkpoint: str | None  # the ckpt_path file on this machine, if any
    recovery: Recovery
    scope: landing.WriteScope  # where the files rank 0 sends back may land
    seed_directories: list[str]  # where this call's own logs and checkpoints go
    run: storage.Run | None = None  # with storage_path: the run's folder, where the ranks write everything
    checkpoint_in_place: bool = False  # every worker reads that file where it is (a Tune trial's, in Tune's storage)
    function_only: bool = False  # no Trainer: a function Fabric launched
    growth: Growth | None = None  # num_workers=(min, max): when it moves onto more workers
    keep_checkpoints: tuple[str, ...] = ()  # the ckpt_path given, which no rotation may remove
    marks: dict[str, float] = field(default_factory=dict)  # the driver's start-up marks (time.time())
    trainer: Any = None  # the driver's Trainer (None: a function Fabric launched)
    # The driver's folder (home.driver_disk) the ranks that stage copy their large files into, made for the first
    # attempt with one; removed when the call ends.
    files_home: str | None = None


def attempt_checkpoint(
    call: DriverCall, infos: Sequence[NodeInfo], driver_node: str
) -> tuple[CheckpointFile | None, CheckpointFile | None]:
    """What an attempt's ranks resume from, for those on the driver's machine and for the others: the survivors'
    state after a worker died (:mod:`.memory`), else the newest recovery checkpoint, else the call's ``ckpt_path``."""
    in_memory = call.recovery.memory_file
    if in_memory is not None:
        return in_memory, in_memory
    path = call.recovery.checkpoint(call.checkpoint)
    return checkpoint_files(
        path,
        local=any(i.node_id == driver_node for i in infos),
        remote=any(i.node_id != driver_node for i in infos),
        # A recovery checkpoint (in the run's folder or the driver's recovery folder), or any checkpoint in the
        # storage path, is read there.
        in_storage=path is not None
        and (
            (path == call.checkpoint and call.checkpoint_in_place)
            or (path != call.checkpoint and call.recovery.checkpoint_run is not None)
            or (call.run is not None and call.run.holds(path))
        ),
    )


def ranks_stage(strategy: Any, call: DriverCall) -> bool:
    return bool(getattr(strategy, "every_rank_writes", False)) and call.run is None


def some_rank_stages(staging: files.StagingArea | None, settings: CallSettings, infos: Sequence[NodeInfo]) -> bool:
    """Whether a rank writes its files into a staging directory this call (they then come home)."""
    if staging is not None:
        return True
    driver_node = driver_node_id()
    return settings.shard_staging is not None and any(info.node_id != driver_node for info in infos)


def staging_area(nodes: Mapping[int, NodeInfo], settings: CallSettings) -> files.StagingArea | None:
    """Rank 0 off the driver's machine writes into a staging directory on its node (with ``node_staging``, the one
    every rank on that node shares)."""
    rank_zero_node = nodes[0].node_id
    if rank_zero_node == driver_node_id():
        return None
    if settings.node_staging and settings.shard_staging is not None:
        return files.StagingArea(rank_zero_node, node_staging_name(settings.shard_staging, rank_zero_node))
    return files.StagingArea.new(rank_zero_node)


def stop_check(
    call: DriverCall, size: int, held: Callable[[], int], reserve: Callable[[Any], None]
) -> Callable[[], RayWorkerError | None]:
    """What ends an attempt early, checked after each message of the workers: a preemption rank 0 checkpointed
    for, or (elastic) room for more workers once a recovery checkpoint arrived. ``held()``: the group's own bundles
    placed and unused whose worker started there is up (:meth:`~.worker_group.WorkerGroup.held_room`);
    ``reserve(pg)``: room found beyond them, reserved for the group (:meth:`~.worker_group.WorkerGroup.extend`)."""
    in_memory = call.recovery.from_memory
    if call.growth is not None:
        call.growth.attempt_started()

    def stop() -> RayWorkerError | None:
        error = call.recovery.stop_for_preemption()
        if error is None and call.growth is not None:
            return call.growth.check(size, call.recovery.latest, held, in_memory, reserve)
        return error

    return stop


def wait_for_output(settings: CallSettings, ranks: list[int], timeout_s: float) -> None:
    """Until what ``ranks`` printed during the call has been printed here (bounded; see channel.worker_output)."""
    if settings.output_marker is not None and ranks:
        output_sync.wait([settings.marker_of(r) for r in ranks], timeout_s)


def keeps_fit(call: DriverCall) -> bool:
    """Whether the call's workers keep its Trainer after it (a fit whose workers wait for the next call): the
    driver's ``trainer.save_checkpoint`` has them write it meanwhile (:mod:`.after_fit`)."""
    trainer = call.trainer
    keep_s = trainer.strategy.workers.timeouts.keep_alive_s if trainer is not None else 0
    return trainer is not None and trainer.state.fn == namespaces.FITTING and keep_s > 0


def seed_directories(trainer: pl.Trainer | None) -> list[str]:
    """Where this call's own logs and checkpoints go (the loggers' version directories, checkpoint folders)."""
    if trainer is None:
        return []
    found = [getattr(logger, "log_dir", None) for logger in trainer.loggers]
    found += [getattr(callback, "dirpath", None) for callback in trainer.checkpoint_callbacks]
    return [os.fspath(d) for d in found if isinstance(d, (str, os.PathLike)) and os.path.isdir(d)]
