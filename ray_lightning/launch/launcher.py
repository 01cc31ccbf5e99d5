"""``RayLauncher``: what Lightning calls instead of re-running ``sys.argv`` (``ddp``) or forking (``ddp_spawn``).

For every ``fit``/``validate``/``test``/``predict`` it

1. connects to Ray (a local one is started if none is running) (:mod:`.session`),
2. enters the callbacks' driver hooks (a ``fit`` given no ``ckpt_path`` resumes from the checkpoint a restored
   Tune trial started with), puts the Trainer, module and arguments into the object store once (:mod:`.payload`),
3. takes the workers the last call of this process left waiting, if they match (:mod:`.idle_pool`); otherwise reserves
   the request, waiting while the autoscaler adds nodes (:mod:`.placement`), and starts one actor per worker
   (:mod:`.worker_group`),
4. runs an *attempt* (:meth:`RayLauncher._attempt`): learns where each worker landed, has rank 0 open the
   rendezvous the strategy asks for, gives each worker its rank, device and environment (:mod:`.contexts`), and
   waits for all of them without polling, meanwhile running what rank 0 sends to the driver (the progress bar,
   Tune reports) (:mod:`.poll`); it returns its outputs, or the :class:`~.failures.Failure` that ended it,
5. after a failure, :func:`~.failures.decide` says whether the workers start again (``max_failures``),
   from rank 0's newest recovery checkpoint (:mod:`.recovery`), or the failure is raised,
6. copies rank 0's results and files onto the driver's Trainer (:mod:`ray_lightning.home`), and the weights the
   workers hold, a chunk at a time (:func:`~.bring_home.weight_chunks`),
7. leaves the workers waiting for the next call (``keep_workers_alive_s``), or stops them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import get_current_placement_group
from typing_extensions import override

from ray_lightning import _lightning, namespaces
from ray_lightning.channel.worker_output import output_sync
from ray_lightning.config.elastic import ElasticSettings
from ray_lightning.environment import RayEnvironment
from ray_lightning.errors import RayWorkerError, WorkerDiedError, WorkerHangError, WorkersGrowError
from ray_lightning.home import files, landing, loggers, storage
from ray_lightning.home.optimizers import left_on_driver
from ray_lightning.home.outbox import new_home, remove_sent
from ray_lightning.launch import idle_pool
from ray_lightning.launch.actor import NodeInfo
from ray_lightning.launch.after_fit import LastFit
from ray_lightning.launch.bring_home import BringsHome
from ray_lightning.launch.call_record import (
    Attempt,
    DriverCall,
    attempt_checkpoint,
    keeps_fit,
    ranks_stage,
    seed_directories,
    some_rank_stages,
    staging_area,
    stop_check,
    wait_for_output,
)
from ray_lightning.launch.contexts import (
    CallSettings,
    build_contexts,
    checkpoints_come_home_warning,
    describe_placement,
    nodes_by_rank,
    progress_interval,
)
from ray_lightning.launch.elastic import Growth
from ray_lightning.launch.failures import ENDS_ITSELF, Decision, classify, decide
from ray_lightning.launch.payload import (
    check_checkpoint_exists,
    checkpoint_argument,
    enter_driver_hooks,
    given_checkpoint,
    prepare_arguments,
    put_payload,
    read_in_place,
)
from ray_lightning.launch.placement import OwnPlacement, TrialPlacement
from ray_lightning.launch.probes import reserve_elastic
from ray_lightning.launch.protocol import LaunchedStrategy
from ray_lightning.launch.recovery import Recovery
from ray_lightning.launch.runs import announce_run
from ray_lightning.launch.session import alive_node_ids, driver_node_id, ensure_ray_initialized
from ray_lightning.launch.watchdog import Watchdog
from ray_lightning.launch.worker_group import GROW_WAIT_S, WorkerGroup

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)

# How long the driver waits for the workers' output to arrive after a call (Ray forwards it every 0.1 s; more only on a
# machine too busy to forward it), and after a worker raised.
_OUTPUT_WAIT_S, _FAILED_OUTPUT_WAIT_S = 10.0, 3.0
# After a worker died, how long a restart waits for the others to come out of the broken call (and answer that they
# can run the next one) before it replaces them too; at a grow (no peer died) longer (GROW_WAIT_S), as it ends once all
# are out.
SALVAGE_WAIT_S = 5.0
# After a lost node, how long a fixed-size fit's survivors wait for Ray to place its bundles again elsewhere before the
# restart starts a new group instead (which waits for the cluster with placement_timeout_s, and starts every process).
PLACED_AGAIN_WAIT_S = 30.0


class RayLauncher(BringsHome, *_lightning.launcher_bases()):
    """Runs a Trainer function on Ray actors; see the module docstring for the steps.

    Only the strategy travels with it to the workers (:meth:`__reduce__`): what a call keeps on the
    driver lives in the call (:mod:`.call_record`), never on the launcher.
    """

    def __init__(self, strategy: LaunchedStrategy) -> None:
        self._strategy = strategy
        self._running: WorkerGroup | None = None  # the group of the attempt under way, for kill()
        # Files the last launch copied from rank 0's node onto the driver's machine.
        self.transferred_files: list[str] = []
        # The workers of the last call, when it was a fit they still hold (after_fit): trainer.save_checkpoint.
        self.last_fit: LastFit | None = None

    def __reduce__(self) -> tuple:
        return type(self), (self._strategy,)

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        return self.run_call(function, args, kwargs, trainer)

    def run_call(self, function: Callable, args: tuple, kwargs: dict, trainer: pl.Trainer | None) -> Any:
        """``function(*args, **kwargs)`` on the workers: a Trainer's, or (``trainer`` None) Fabric's launched one."""
        if trainer is not None:
            self._strategy.check_trainer(trainer)
        marks = {"fit called (driver)": time.time()}
        ensure_ray_initialized()
        marks["Ray ready (driver)"] = time.time()
        with contextlib.ExitStack() as stack:
            args, kwargs = enter_driver_hooks(function, args, kwargs, trainer, stack)
            check_checkpoint_exists(function, args, kwargs)
            ends = prepare_arguments(trainer, args, kwargs, self._strategy.resources)
            try:
                return self._launch(function, args, kwargs, trainer, marks)
            finally:
                for end in ends:
                    end()

    def _launch(
        self, function: Callable, args: tuple, kwargs: dict, trainer: pl.Trainer | None, marks: dict[str, float]
    ) -> Any:
        # With storage_path: the run's folder, checked writable; the Trainer's directories are placed in it.
        self.last_fit = None  # this call's workers clean up the last fit's state first
        workers, elastic = self._strategy.workers, self._elastic(trainer)
        run = storage.open_run(trainer, workers.storage, self._strategy.run_name_now)
        if trainer is not None:
            # Where rank 0 writes and which logger runs it continues (home.loggers).
            loggers.prepare_on_driver(trainer)
        scope = landing.WriteScope.of(trainer, loggers.output_directories(trainer) if trainer else ())
        given = given_checkpoint(function, args, kwargs)
        with left_on_driver(trainer):
            payload = put_payload(trainer, function, args, kwargs, None if trainer is not None else self._strategy)
        call = DriverCall(
            checkpoint=(checkpoint := checkpoint_argument(function, args, kwargs, trainer)),
            checkpoint_in_place=read_in_place(trainer, checkpoint),
            seed_directories=seed_directories(trainer),
            payload=payload,
            recovery=Recovery(
                workers.recovery, scope, self._strategy.restarts, run, elastic, self._strategy.state_in_every_rank
            ),
            scope=scope,
            run=run,
            keep_checkpoints=files.path_forms(given),
            function_only=trainer is None,
            growth=Growth(elastic, workers.resources, trainer.max_epochs, trainer.max_steps) if elastic else None,
            marks=marks,
            trainer=trainer,
        )
        marks["payload put (driver)"] = time.time()
        if run is not None:
            announce_run(self._strategy, call, trainer, given)
        self.transferred_files = []
        try:
            attempt = self._attempts(call)
            self._publish_times(attempt, call)
            environment = getattr(self._strategy, "cluster_environment", None)
            if isinstance(environment, RayEnvironment):
                environment.ran_on(len(attempt.group.ranks))
            try:
                # The workers stay until their results are home: they hold the weights' chunks.
                return self._bring_home(attempt, trainer, call)
            finally:
                self._release(attempt.group)
                if keeps_fit(call):
                    here = driver_node_id()
                    on_driver_machine = all(info.node_id == here for info in attempt.nodes.values())
                    self.last_fit = LastFit(attempt.group, on_driver_machine, call.run)
        finally:
            self._running = None
            call.recovery.close()
            if call.files_home is not None:
                remove_sent(call.files_home)
            if call.growth is not None:
                call.growth.close()

    def _elastic(self, trainer: pl.Trainer | None) -> ElasticSettings | None:
        """The elastic settings a call uses: a Trainer's fit outside a Tune trial (whose bundles are fixed)."""
        elastic = self._strategy.workers.elastic
        fitting = trainer is not None and trainer.state.fn == namespaces.FITTING
        return elastic if fitting and get_current_placement_group() is None else None

    def _attempts(self, call: DriverCall) -> Attempt:
        """Attempts of the call until one succeeds, or a failure no restart follows is raised."""
        group = self._acquire_group(call)
        call.marks.setdefault("workers placed (driver)", time.time())
        while True:
            if call.growth is not None:
                call.growth.ask_autoscaler(len(group.ranks))
            attempt = self._attempt(group, call)
            if attempt.failure is None:
                return attempt
            decision = decide(attempt.failure, call.recovery.failures_restarted, call.recovery.settings.max_failures)
            group = self._after_failure(attempt, decision, call)

    def _after_failure(self, attempt: Attempt, decision: Decision, call: DriverCall) -> WorkerGroup:
        """Raise the failure, or return the group the next attempt runs on."""
        failure = attempt.failure
        assert failure is not None
        grow = failure.error.size if decision.keep_processes and isinstance(failure.error, WorkersGrowError) else 0
        # A grow: into the fit's own bundles (launch.elastic), every rank left the call at its next batch (group.run).
        wait_s = GROW_WAIT_S if grow else SALVAGE_WAIT_S
        if not decision.keep_processes and failure.kind not in ENDS_ITSELF:
            attempt.group.shutdown()  # the workers are well (a drain, a hang): stopped, or they would train on
        # Rank 0's files since its last recovery checkpoint, on a node that is gone, are lost: the restart goes back to
        # it, which the files here match (from the survivors' memory, the log would miss steps).
        files_lost = attempt.staging is not None and not self._fetch_staged_files(attempt.staging, call, attempt.group)
        if not decision.keep_processes:
            attempt.group.shutdown()
        if not decision.restart:
            raise call.recovery.final_error(failure.error) from failure.error.__cause__
        group = None
        if decision.keep_processes:
            # A worker died or a node was lost: the others' processes go on where they can (launch.worker_group).
            try:
                elastic = self._strategy.workers.elastic if call.growth is not None else None
                placed_wait_s = min(self._strategy.workers.timeouts.placement_s, PLACED_AGAIN_WAIT_S)
                group = attempt.group.salvage(wait_s, elastic and elastic.min_workers, placed_wait_s, grow)
            except BaseException:
                attempt.group.shutdown()
                raise
        survivors = group.survivors if group is not None and not files_lost else []
        if group is None:
            group = self._acquire_group(call)
        # A replicated fit goes on from the survivors' state when they hold one (launch.memory).
        call.recovery.record_restart(failure, len(group.ranks), survivors, group.spares_taken)
        return group

    @override
    def kill(self, signum: Any) -> None:
        if self._running is not None:
            self._running.shutdown()

    def _acquire_group(self, call: DriverCall) -> WorkerGroup:
        """The workers for this call: the last call's idle workers, a Tune trial's bundles, or new ones (an elastic
        fit's: as many as the cluster places now, :func:`~.probes.reserve_elastic`)."""
        workers = self._strategy.workers
        request, timeouts = workers.resources, workers.timeouts
        enclosing = get_current_placement_group()
        group = idle_pool.take(request, within=enclosing)
        if group is None and enclosing is not None:
            # After a node loss, the trial's lost bundles are placed again (maybe on a node the autoscaler adds).
            wait_s = max(timeouts.placement_s, timeouts.scale_up_s)
            return WorkerGroup.start(TrialPlacement.within(enclosing, request, wait_s), request)
        if group is not None and call.growth is not None and len(group.ranks) < request.num_workers:
            group.shutdown()  # idle workers of an earlier fit that ran on fewer: a fit asks for the most
            group = None
        if group is None:
            say = namespaces.of(self._strategy).pl("utilities.rank_zero.rank_zero_info")
            elastic = workers.elastic
            if elastic is not None:
                low = elastic.min_workers
                placement = reserve_elastic(request, low, timeouts.placement_s, timeouts.scale_up_s, say)
                say(f"ray_lightning: {len(placement.bundles)} workers (num_workers=({low}, {request.num_workers}))")
                return WorkerGroup.start(placement, request.with_workers(len(placement.bundles)))
            placement = OwnPlacement.reserve(request, timeouts.placement_s, timeouts.scale_up_s, say)
            group = WorkerGroup.start(placement, request)
        return group

    def _attempt(self, group: WorkerGroup, call: DriverCall) -> Attempt:
        """Run the call once on ``group``; a failure is returned, not raised (Ctrl-C stops the group and is raised)."""
        timeouts = self._strategy.workers.timeouts
        self._running = group
        nodes: dict[int, NodeInfo] = {}
        staging: files.StagingArea | None = None
        channel, settings = None, CallSettings()
        try:
            channel = group.channel()
            channel.on_object = call.recovery.receive
            settings = CallSettings(
                channel.queue,
                progress_interval(timeouts.start_s, timeouts.progress_s),
                output_sync.new_marker(),
                # Every rank of a sharded strategy writes its part of each checkpoint (into storage: in place).
                files.new_staging_name() if ranks_stage(self._strategy, call) else None,
                call.keep_checkpoints,
                call.run is not None,
                node_staging=call.function_only,
            )
            infos = group.node_infos(timeouts.start_s)
            call.marks.setdefault("workers up, their imports done (driver)", time.time())
            restarts = call.recovery.settings  # spares start now: imported by the time a worker dies
            group.keep_spares(restarts.enabled and restarts.spare_workers)
            nodes = {r.global_rank: info for r, info in zip(group.ranks, infos)}
            staging = staging_area(nodes, settings) if call.run is None else None
            if call.files_home is None and some_rank_stages(staging, settings, infos):
                call.files_home = new_home()
            settings = replace(settings, files_home=call.files_home)
            contexts = self._contexts(group, infos, staging, settings, call)
            watchdog = Watchdog([r.global_rank for r in group.ranks], infos, timeouts.progress_s, timeouts.start_s)
            outputs = group.run(
                call.payload,
                contexts,
                channel,
                watchdog,
                stop_check(call, len(group.ranks), group.held_room, group.extend),
                keeps_fit(call),
                self._strategy.collective_errors,
            )
            channel.run_remaining()
            wait_for_output(settings, [r.global_rank for r in group.ranks], _OUTPUT_WAIT_S)
            return Attempt(group, outputs, nodes, staging, watchdog=watchdog)
        except Exception as error:  # noqa: BLE001 - every failure becomes the attempt's record, decided on next
            learned = time.time()  # before the waits for what the workers sent
            if isinstance(error, RayWorkerError) and channel is not None:
                self._after_worker_error(error, channel, settings, call)
            failure = replace(classify(error, nodes, alive_node_ids(), self._strategy.collective_errors), at=learned)
            return Attempt(group, None, nodes, staging, failure)
        except BaseException:
            group.shutdown()
            raise

    def _after_worker_error(
        self, error: RayWorkerError, channel: Any, settings: CallSettings, call: DriverCall
    ) -> None:
        """What arrives after a worker failed: a recovery checkpoint rank 0 sent, the failed rank's output."""
        if call.recovery.enabled:
            _take_last_checkpoint(channel)
        if not isinstance(error, (WorkerHangError, WorkerDiedError, WorkersGrowError)):
            # A stuck rank writes no marker, nor does a dead one; nor a growing fit's, which trains on until stopped.
            wait_for_output(settings, [error.rank], _FAILED_OUTPUT_WAIT_S)

    def _release(self, group: WorkerGroup) -> None:
        """After a call that succeeded: leave the workers for the next call, or stop them."""
        workers = self._strategy.workers
        keep_s = workers.timeouts.keep_alive_s
        if keep_s > 0:
            # Inside a Tune trial's placement group: for the next trial that Tune runs in this process with it.
            within = None if group.owns_placement else group.placement.pg
            idle_pool.keep(workers.resources, group, keep_s, within=within)
        else:
            group.shutdown()

    def _contexts(
        self,
        group: WorkerGroup,
        infos: list[NodeInfo],
        staging: files.StagingArea | None,
        settings: CallSettings,
        call: DriverCall,
    ) -> list[Any]:
        """Each worker's rank, device and rendezvous, from where the actors landed."""
        timeout_s = self._strategy.workers.timeouts.start_s
        point = group.open_rendezvous(self._strategy.rendezvous, nodes_by_rank(group.ranks, infos), timeout_s)
        driver_node = driver_node_id()
        shipped = attempt_checkpoint(call, infos, driver_node)
        rank_zero_info = namespaces.of(self._strategy).pl("utilities.rank_zero.rank_zero_info")
        resources = self._strategy.workers.resources
        if len(group.ranks) != resources.num_workers and not resources.num_hosts:
            resources = resources.with_workers(len(group.ranks))  # an elastic fit's size now
        described = resources.describe()
        rank_zero_info(describe_placement(described, group.ranks, infos, group.calls > 0))
        if call.run is None and not getattr(self._strategy, "_warned_checkpoints_home", False):
            restarts = self._strategy.workers.recovery.enabled
            warning = checkpoints_come_home_warning(call.trainer, restarts, infos, driver_node)
            if warning is not None:
                self._strategy._warned_checkpoints_home = True
                namespaces.of(self._strategy).pl("utilities.rank_zero.rank_zero_warn")(warning)
        fitting = call.trainer is not None and call.trainer.state.fn == namespaces.FITTING
        plan = call.recovery.plan(infos, fitting)
        if plan is not None and staging is not None and call.recovery.restarts:
            # A restarted rank 0 that stages starts from what this call wrote so far (logs it appends to).
            plan = replace(plan, seed=ray.put(call.recovery.seed_files(call.seed_directories, call.files_home)))
        return build_contexts(group.ranks, infos, point, driver_node, staging, shipped, settings, plan)


def _take_last_checkpoint(channel: Any) -> None:
    """After a failure: read what rank 0 sent before it (a recovery checkpoint may be on its way)."""
    try:
        channel.run_remaining(timeout_s=_FAILED_OUTPUT_WAIT_S)
    except Exception as error:  # noqa: BLE001 - the queue's node may be gone; keep the checkpoint before
        log.debug("ray_lightning: the driver channel could not be read after the failure: %s", error)
