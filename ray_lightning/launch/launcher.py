"""``RayLauncher``: what Lightning calls instead of re-running ``sys.argv`` (``ddp``) or forking (``ddp_spawn``).

For every ``fit``/``validate``/``test``/``predict`` it

1. connects to Ray (a local one is started if none is running) (:mod:`.session`),
2. puts the Trainer, the module and the arguments into the object store once (:mod:`.payload`),
3. takes the workers the last call of this process left waiting, if they match (:mod:`.idle_pool`);
   otherwise checks that the cluster (with what its autoscaler can add) can hold the request and
   reserves it (:mod:`.placement`, waiting at most ``placement_timeout_s``, or ``scale_up_timeout_s``
   while the autoscaler adds nodes), and starts one actor per worker (:mod:`.worker_group`),
4. learns where each worker landed, has rank 0 open the rendezvous the strategy asks for, and gives
   each worker its rank, device and environment (:mod:`.contexts`),
5. waits for all of them without polling, meanwhile running what rank 0 sends to the driver (the
   progress bar, Tune reports); the first failure stops the group and is raised with its rank and
   traceback (:mod:`.poll`). With ``max_failures``, a failure a restart can fix (a lost worker or
   node, a preemption) starts the workers again from rank 0's newest recovery checkpoint instead
   (:mod:`.recovery`),
6. copies rank 0's results and files onto the driver's Trainer (:mod:`ray_lightning.home`), and the
   weights the workers still hold, asking for them a chunk at a time (:func:`weight_chunks`),
7. leaves the workers waiting for the next call (``keep_workers_alive_s``), or stops them.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import get_current_placement_group
from typing_extensions import override

from ray_lightning import _lightning, namespaces
from ray_lightning.channel.worker_output import output_sync
from ray_lightning.config import SALVAGE_WAIT_S
from ray_lightning.errors import RayWorkerError, WorkerDiedError, WorkerHangError
from ray_lightning.home import files, loggers
from ray_lightning.home.predictions import merge_predictions
from ray_lightning.home.results import WorkerOutput, apply_to_driver
from ray_lightning.launch import idle_pool
from ray_lightning.launch.actor import NodeInfo
from ray_lightning.launch.contexts import (
    CallSettings,
    build_contexts,
    describe_placement,
    nodes_by_rank,
    progress_interval,
)
from ray_lightning.launch.payload import check_checkpoint_exists, checkpoint_argument, checkpoint_files, put_payload
from ray_lightning.launch.placement import TrialPlacement, reserve_own_placement
from ray_lightning.launch.protocol import LaunchedStrategy
from ray_lightning.launch.recovery import Recovery
from ray_lightning.launch.session import driver_node_id, ensure_ray_initialized
from ray_lightning.launch.watchdog import Watchdog
from ray_lightning.launch.worker_group import WorkerGroup
from ray_lightning.runtime import WorkerContext

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)

# How long the driver waits for the workers' output to arrive after a call (Ray forwards it every
# 0.1 s; more only on a machine too busy to forward it), and after a worker raised.
_OUTPUT_WAIT_S = 10.0
_FAILED_OUTPUT_WAIT_S = 3.0


class RayLauncher(*_lightning.launcher_bases()):
    """Runs a Trainer function on Ray actors; see the module docstring for the steps."""

    def __init__(self, strategy: LaunchedStrategy) -> None:
        self._strategy = strategy
        # The group of an attempt whose worker died, until the restart decides what to keep of it.
        self._broken: WorkerGroup | None = None
        self._group: WorkerGroup | None = None
        # Where rank 0 stages its files while a call whose rank 0 is off the driver's machine runs.
        self._staging: files.StagingArea | None = None
        self._scope = files.WriteScope()
        self._seed_directories: list[str] = []
        # Where each rank of the running attempt is: the driver names the node of a failed rank.
        self._nodes: dict[int, NodeInfo] = {}
        # Files the last launch copied from rank 0's node onto the driver's machine.
        self.transferred_files: list[str] = []

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None:
            self._strategy.check_trainer(trainer)
        ensure_ray_initialized()
        check_checkpoint_exists(function, args, kwargs)
        if trainer is not None:
            _fix_output_locations(trainer)
        # Where the files rank 0 sends back may land, as the driver has it now.
        self._scope = files.WriteScope.of(trainer, loggers.output_directories(trainer) if trainer else ())
        self._seed_directories = _seed_directories(trainer)
        checkpoint = checkpoint_argument(function, args, kwargs, trainer)
        payload = put_payload(trainer, function, args, kwargs)
        recovery = Recovery(self._strategy.recovery, self._scope, self._strategy.restarts)
        self.transferred_files = []
        try:
            outputs, group = self._attempts(payload, checkpoint, recovery)
            try:
                # The workers stay until their results are home: they hold the weights' chunks.
                return self._bring_home(group, outputs, trainer, recovery)
            finally:
                self._release(group)
        finally:
            recovery.close()

    def _attempts(
        self, payload: ray.ObjectRef, checkpoint: str | None, recovery: Recovery
    ) -> tuple[list[WorkerOutput | None], WorkerGroup]:
        """Run the call until it succeeds, restarting its workers after failures a restart can fix."""
        salvaged: WorkerGroup | None = None
        while True:
            try:
                group, salvaged = salvaged or self._acquire_group(), None
                return self._run(group, payload, recovery.checkpoint(checkpoint), recovery), group
            except BaseException as error:
                broken, self._broken = self._broken, None
                if not recovery.restart_after(error, self._nodes):
                    if broken is not None:
                        broken.shutdown()
                    final = recovery.final_error(error)
                    if final is error:
                        raise
                    raise final from error.__cause__
                if broken is not None:
                    # A worker process died: the others' processes go on where they can (launch.worker_group).
                    try:
                        salvaged = broken.salvage(SALVAGE_WAIT_S)
                    except BaseException:
                        broken.shutdown()
                        raise

    @override
    def kill(self, signum: Any) -> None:
        if self._group is not None:
            self._group.shutdown()

    def _acquire_group(self) -> WorkerGroup:
        """The workers for this call: a Tune trial's bundles, the last call's idle workers, or new ones."""
        strategy = self._strategy
        request = strategy.resources
        enclosing = get_current_placement_group()
        if enclosing is not None:
            # After a node loss, the trial's lost bundles are placed again (maybe on a node the autoscaler adds).
            wait_s = max(strategy.placement_timeout_s, strategy.scale_up_timeout_s)
            return WorkerGroup.start(TrialPlacement.within(enclosing, request, wait_s), request)
        group = idle_pool.take(request)
        if group is None:
            say = namespaces.of(strategy).pl("utilities.rank_zero.rank_zero_info")
            placement = reserve_own_placement(request, strategy.placement_timeout_s, strategy.scale_up_timeout_s, say)
            group = WorkerGroup.start(placement, request)
        return group

    def _run(
        self, group: WorkerGroup, payload: ray.ObjectRef, checkpoint: str | None, recovery: Recovery
    ) -> list[WorkerOutput | None]:
        strategy = self._strategy
        self._group, self._staging, self._nodes = group, None, {}
        succeeded = False
        try:
            channel = group.channel()
            channel.on_object = recovery.receive
            call = CallSettings(
                channel.queue,
                progress_interval(strategy.worker_start_timeout_s, strategy.progress_timeout_s),
                output_sync.new_marker(),
                # Every rank of a sharded strategy writes its part of each checkpoint.
                files.new_staging_name() if getattr(strategy, "every_rank_writes", False) else None,
            )
            contexts = self._contexts(group, call, checkpoint, recovery)
            watchdog = Watchdog(
                [r.global_rank for r in group.ranks],
                group.infos,
                strategy.progress_timeout_s,
                strategy.worker_start_timeout_s,
            )
            try:
                outputs = group.run(payload, contexts, channel, watchdog)
            except RayWorkerError as error:
                if recovery.enabled:
                    _take_last_checkpoint(channel)
                if isinstance(error, WorkerDiedError) and recovery.enabled:
                    self._broken = group  # the restart keeps what it can of it
                if not isinstance(error, (WorkerHangError, WorkerDiedError)):
                    # A stuck rank writes no marker, nor does a dead one.
                    _wait_for_output(call, [error.rank], _FAILED_OUTPUT_WAIT_S)
                raise
            channel.run_remaining()
            _wait_for_output(call, [r.global_rank for r in group.ranks], _OUTPUT_WAIT_S)
            succeeded = True
        finally:
            self._group = None
            if not succeeded and self._broken is not group:
                group.shutdown()
                if self._staging is not None:
                    recovery.synced.update(self._fetch_staged_files())
        return outputs

    def _release(self, group: WorkerGroup) -> None:
        """After a call that succeeded: leave the workers for the next call, or stop them."""
        strategy = self._strategy
        if group.owns_placement and strategy.keep_workers_alive_s > 0:
            idle_pool.keep(strategy.resources, group, strategy.keep_workers_alive_s)
        else:
            group.shutdown()

    def _contexts(
        self, group: WorkerGroup, call: CallSettings, checkpoint: str | None, recovery: Recovery
    ) -> list[WorkerContext]:
        """Each worker's rank, device and rendezvous, from where the actors landed."""
        timeout_s = self._strategy.worker_start_timeout_s
        infos = group.node_infos(timeout_s)
        self._nodes = {r.global_rank: info for r, info in zip(group.ranks, infos)}
        point = group.open_rendezvous(self._strategy.rendezvous, nodes_by_rank(group.ranks, infos), timeout_s)
        driver_node = driver_node_id()
        rank_zero_node = nodes_by_rank(group.ranks, infos)[0]
        # Rank 0 off the driver's machine writes into a staging directory on its node.
        self._staging = files.StagingArea.new(rank_zero_node) if rank_zero_node != driver_node else None
        shipped = checkpoint_files(
            checkpoint,
            local=any(i.node_id == driver_node for i in infos),
            remote=any(i.node_id != driver_node for i in infos),
        )
        rank_zero_info = namespaces.of(self._strategy).pl("utilities.rank_zero.rank_zero_info")
        rank_zero_info(describe_placement(self._strategy.resources.describe(), group.ranks, infos, group.calls > 0))
        plan = recovery.plan(infos)
        if plan is not None and self._staging is not None and recovery.restarts:
            # A restarted rank 0 that stages starts from what this call wrote so far (logs it appends to).
            plan = replace(plan, seed=ray.put(recovery.seed_files(self._seed_directories)))
        return build_contexts(group.ranks, infos, point, driver_node, self._staging, shipped, call, plan)

    def _bring_home(
        self, group: WorkerGroup, outputs: list[WorkerOutput | None], trainer: pl.Trainer | None, recovery: Recovery
    ) -> Any:
        rank_zero = next(o for o in outputs if o is not None and o.trainer_state is not None)
        if trainer is None:
            return rank_zero.results
        written = apply_to_driver(trainer, rank_zero, self._scope, weight_chunks(group.actors, outputs))
        for output in outputs:
            if output is not None and output is not rank_zero and output.files:
                # Other ranks' parts of sharded checkpoints, beside rank 0's.
                written += files.write(output.files, self._scope.with_checkpoints(rank_zero.callback_states))
        if rank_zero.staged:
            # What rank 0 mirrored here during the call and no longer had at its end, it removed.
            files.remove(recovery.synced - set(rank_zero.files), self._scope)
        self.transferred_files = sorted((set(self.transferred_files) | recovery.synced | set(written)) - {""})
        self.transferred_files = [p for p in self.transferred_files if os.path.isfile(p)]
        if self.transferred_files:
            log.info("ray_lightning: copied %s from rank 0's node to this machine", ", ".join(self.transferred_files))
        if trainer.state.fn == namespaces.PREDICTING:
            if not rank_zero.return_predictions:
                return None
            per_rank = [o.predictions or [] for o in outputs if o is not None]
            return merge_predictions(per_rank, rank_zero.num_predict_dataloaders)
        return rank_zero.results

    def _fetch_staged_files(self) -> list[str]:
        """After a failure: copy what rank 0 had written on its node (checkpoints, logs) to the driver."""
        assert self._staging is not None
        area, self._staging = self._staging, None
        try:
            written = files.fetch_after_failure(area, self._strategy.worker_start_timeout_s, self._scope)
        except Exception as error:  # noqa: BLE001 - the node may be gone; the failure itself is what matters
            log.warning("ray_lightning: could not fetch the files rank 0 wrote before the failure: %s", error)
            return []
        self.transferred_files = sorted(set(self.transferred_files) | set(written))
        if written:
            log.warning("ray_lightning: copied what rank 0 wrote before the failure: %s", ", ".join(written))
        return written

    def __getstate__(self) -> dict:
        # Shipped to the workers inside the Trainer: actor handles stay on the driver.
        state = self.__dict__.copy()
        state["_group"] = state["_staging"] = state["_broken"] = None
        state["_nodes"] = {}
        return state


def weight_chunks(actors: list[Any], outputs: list[WorkerOutput | None], in_flight: int = 2) -> Iterator[Any]:
    """References to every chunk of trained weights the workers hold, asked for a few at a time.

    ``outputs`` are in actor order. While the driver copies one chunk into its module, the next is on
    its way; one that was read goes from the object store when its reference does.
    """
    counts = [(actor, out.weights if out is not None and out.weights else 0) for actor, out in zip(actors, outputs)]
    wanted = [(actor, index) for actor, count in counts for index in range(count)]
    pending: deque[Any] = deque()
    for actor, index in wanted:
        pending.append(actor.weights_chunk.remote(index))
        if len(pending) >= in_flight:
            yield pending.popleft()
    while pending:
        yield pending.popleft()


def _wait_for_output(call: CallSettings, ranks: list[int], timeout_s: float) -> None:
    """Until what ``ranks`` printed during the call has been printed here (bounded; see channel.worker_output)."""
    if call.output_marker is not None and ranks:
        output_sync.wait([call.marker_of(r) for r in ranks], timeout_s)


def _fix_output_locations(trainer: pl.Trainer) -> None:
    """On the driver: settle where rank 0 writes and which logger runs it continues (``home.loggers``)."""
    loggers.prepare_on_driver(trainer)


def _take_last_checkpoint(channel: Any) -> None:
    """After a failure: read what rank 0 sent before it (a recovery checkpoint may be on its way)."""
    try:
        channel.run_remaining(timeout_s=_FAILED_OUTPUT_WAIT_S)
    except Exception as error:  # noqa: BLE001 - the queue's node may be gone; keep the checkpoint before
        log.debug("ray_lightning: the driver channel could not be read after the failure: %s", error)


def _seed_directories(trainer: pl.Trainer | None) -> list[str]:
    """Where this call's own logs and checkpoints go (the loggers' version directories, checkpoint folders)."""
    if trainer is None:
        return []
    found = [getattr(logger, "log_dir", None) for logger in trainer.loggers]
    found += [getattr(callback, "dirpath", None) for callback in trainer.checkpoint_callbacks]
    return [os.fspath(d) for d in found if isinstance(d, (str, os.PathLike)) and os.path.isdir(d)]
