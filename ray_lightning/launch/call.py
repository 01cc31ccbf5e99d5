"""One ``fit``/``validate``/``test``/``predict`` inside a worker: set up, run the Trainer function, collect, clean up.

:class:`WorkerCall` is what :meth:`ray_lightning.launch.actor.RayWorker.execute` does: it sets the
environment the launcher decided (ranks, ``MASTER_ADDR``, ``CUDA_VISIBLE_DEVICES``, the driver's
forwarded variables and torch flags), unpickles the payload only then (nothing may initialise
CUDA before ``CUDA_VISIBLE_DEVICES`` is set, and the module may come from a directory only the
driver had on ``sys.path``), makes the worker's context current (:mod:`ray_lightning.runtime`),
hands the strategy its rank and rendezvous, runs the function and collects what goes home.
:meth:`WorkerCall.finish` undoes it all after the results were sent, for the next call.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from ray_lightning import namespaces, runtime
from ray_lightning.channel.heartbeat import Heartbeat, HeartbeatCallback
from ray_lightning.channel.progress import readable_output
from ray_lightning.channel.worker_output import end_of_output
from ray_lightning.data.elastic import ElasticTraining
from ray_lightning.home import files, loggers, snapshot, storage
from ray_lightning.home.outbox import Outbox
from ray_lightning.home.predictions import PredictionRecorder
from ray_lightning.home.recovery import RecoveryCheckpoints, RestoreRandomStates
from ray_lightning.home.results import WorkerOutput, collect_worker_output
from ray_lightning.home.snapshot import LeavesWhenInterrupted, MemorySnapshot
from ray_lightning.launch import priority
from ray_lightning.launch.payload import with_checkpoint_path
from ray_lightning.launch.preemption import PreemptionWatch, SigtermFirst, where_this_runs
from ray_lightning.launch.weights_out import take_weights
from ray_lightning.runtime import WorkerContext

if TYPE_CHECKING:
    import pytorch_lightning as pl


class WorkerCall:
    """One call in this worker process, with the rank and rendezvous ``context`` and ``store`` give it."""

    def __init__(self, context: WorkerContext, store: Any, started: dict[str, float] | None = None) -> None:
        self.context = context
        self._store = store
        self._started = started or {}  # the process's start-up marks (RayWorker.started)
        self._strategy: Any = None
        self._saved_environment: dict[str, str] = {}
        self._watch: PreemptionWatch | None = None
        self.fitted: pl.Trainer | None = None  # a fit's Trainer, after it succeeded, until finish()

    def run(self, payload: ray.ObjectRef) -> WorkerOutput | None:
        """Run the Trainer function the payload holds; returns what this rank sends home."""
        context = self.context
        self._saved_environment = dict(os.environ)  # this call's variables, and those it sets itself, go afterwards
        _set_environment(context)
        priority.hold(context.niceness)  # the driver's, not Ray's (launch.priority)
        for path in context.driver_sys_path:
            if path not in sys.path and os.path.isdir(path):
                sys.path.append(path)
        heartbeat = None
        if context.progress_interval_s is not None and context.driver_queue is not None:
            heartbeat = Heartbeat(context.rank.global_rank, context.driver_queue, context.progress_interval_s)
            heartbeat.clock.startup.update(self._started)
            heartbeat.clock.mark_startup("call received")
        self._watch = PreemptionWatch(context.recovery, context.rank.global_rank, where_this_runs())
        try:
            with runtime.activated(context, heartbeat), self._watch:
                if heartbeat is not None:
                    heartbeat.start()
                runtime.mark_progress("unpickling the Trainer and module", startup=True)
                trainer, function, args, kwargs, weights, strategy = ray.get(payload)
                runtime.mark_progress("receiving the module's weights", startup=True)
                take_weights(weights)
                if trainer is None:
                    return self._run_function(strategy, function, args, kwargs)
                return self._run(trainer, function, args, kwargs)
        finally:
            if heartbeat is not None:
                heartbeat.stop()
            end_of_output(context.output_marker)

    def _run(self, trainer: pl.Trainer, function: Callable, args: tuple, kwargs: dict) -> WorkerOutput | None:
        context = self.context
        with contextlib.ExitStack() as scratch:
            if context.checkpoint_file is not None:
                path = _local_checkpoint(context.checkpoint_file, scratch)
                args, kwargs = with_checkpoint_path(function, args, kwargs, path)
            # Kept if the call fails: the launcher fetches what is in it (home.files.fetch_after_failure).
            staging = files.staging_dir(context.staging_name) if context.staging_name else None
            rank_zero = context.rank.global_rank == 0
            if staging is not None and rank_zero:
                files.stage(trainer, staging)
            elif staging is not None:
                files.make_private_dir(staging)  # this rank's part of the sharded checkpoints
            # The ranks write checkpoints in the background: into storage_path, or the recovery checkpoints of a fit
            # that may restart into the driver's recovery folder (home.driver_disk).
            recovery_run = context.recovery.storage_run if context.recovery is not None else None
            uses_storage = trainer.strategy.workers.storage.enabled or recovery_run is not None
            if uses_storage:
                storage.reset_uploads()
                storage.forget_cached_filesystems()  # this call's credentials and endpoints (AWS_*...)
            _add_recovery(trainer, context, staging)
            self._strategy = strategy = trainer.strategy
            strategy.attach_worker(context, self._store)
            init_hook = strategy.workers.init_hook
            if init_hook is not None:
                runtime.mark_progress("init_hook", startup=True)
                init_hook()
            recorder = None
            if trainer.state.fn == namespaces.PREDICTING:
                recorder = PredictionRecorder()
                trainer.callbacks.append(recorder)
            if context.progress_interval_s is not None:
                # One callback puts the SIGTERM handler back in front and marks progress (HeartbeatCallback).
                clock = runtime.step_clock()
                trainer.callbacks.append(HeartbeatCallback(loop_started=self._watch.install, clock=clock))
            else:
                trainer.callbacks.append(SigtermFirst(self._watch))
            # Rank 0 closes its runs before they are collected.
            logging_runs = loggers.in_worker(trainer, staging if rank_zero else None)
            try:
                with readable_output(rank_zero, progress_to_driver=context.driver_queue is not None), logging_runs:
                    results = function(*args, **kwargs)
            except BaseException:
                snapshot.keep_after_failure(trainer)  # what a restart may go on from (a replicated fit's state)
                if uses_storage:
                    # A restart may read the checkpoint the uploads left would replace: they write no marker.
                    storage.uploads().abandon()
                raise
            if uses_storage:
                runtime.mark_progress("collecting the results", "waiting for the last checkpoint's upload")
                storage.uploads().wait()  # fit returns once the last checkpoint is in storage, or raises naming it
                storage.uploads().close()
            runtime.mark_progress("collecting the results")
            output = collect_worker_output(trainer, results, recorder, staging, context.files_home)
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
        if trainer.state.fn == namespaces.FITTING:
            self.fitted = trainer
        return output

    def save_after_fit(self, filepath: str, weights_only: bool) -> None:
        """The driver's ``trainer.save_checkpoint`` after the fit, in this rank's Trainer of it (:mod:`.after_fit`)."""
        trainer = self.fitted
        assert trainer is not None
        uses_storage = trainer.strategy.workers.storage.enabled
        if uses_storage:
            storage.reset_uploads()  # the fit's were closed when it returned
        trainer.save_checkpoint(filepath, weights_only=weights_only)
        if uses_storage:
            storage.uploads().wait()
            storage.uploads().close()

    def _run_function(self, strategy: Any, function: Callable, args: tuple, kwargs: dict) -> WorkerOutput | None:
        """A function without a Trainer (Fabric's ``launch``): run it with the strategy attached; rank 0 sends
        its return value, and every rank that staged sends the files it wrote (``fabric.save``, the loggers')."""
        context = self.context
        rank_zero = context.rank.global_rank == 0
        staging = files.staging_dir(context.staging_name) if context.staging_name else None
        if staging is not None:
            files.make_private_dir(staging)
        if strategy.workers.storage.enabled:
            storage.forget_cached_filesystems()  # this call's credentials and endpoints (AWS_*...)
        self._strategy = strategy
        strategy.attach_worker(context, self._store, staging)
        if strategy.workers.init_hook is not None:
            runtime.mark_progress("init_hook", startup=True)
            strategy.workers.init_hook()
        assert self._watch is not None
        self._watch.install()  # SIGTERM (preemption) reaches the watch before the function's own handlers
        try:
            with readable_output(rank_zero, progress_to_driver=False):
                results = function(*args, **kwargs)
        except BaseException:
            with contextlib.suppress(Exception):  # what the loggers hold, for the rerun; the failure is what matters
                strategy.function_ended(succeeded=False)
            raise
        runtime.mark_progress("collecting the results")
        strategy.function_ended(succeeded=True)
        # The ranks of a node share its staging directory: its local rank 0 sends it, once they all wrote.
        sent = {}
        if staging is not None and context.rank.local_rank == 0:
            sent = files.collect(staging, Outbox(context.files_home))
            shutil.rmtree(staging, ignore_errors=True)
        if not rank_zero and not sent:
            return None
        rank = context.rank.global_rank
        results = namespaces.to_cpu(results) if rank_zero else None
        return WorkerOutput(rank, results=results, files=sent, staged=staging is not None)

    def finish(self) -> None:
        """After the call: leave its process group and environment (its results were sent, or it failed and a
        restart runs the next call in this process)."""
        import torch

        self.fitted = None
        if self._strategy is not None:
            self._strategy.detach_worker()
        # Rank 0's rendezvous stops listening now, not when the process ends (Horovod's server
        # thread would keep its socket open for good).
        close = getattr(self._store, "close", None)
        if close is not None:
            close()
        self._strategy = self._store = None
        os.environ.clear()
        os.environ.update(self._saved_environment)
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # a waiting worker should not hold cached GPU memory
        # Ray's niceness, while the process waits for the next call: only now, as the clean-up above runs at the
        # call's (at Ray's 15, on a busy node, it took seconds after a failed call before a restart could begin).
        priority.release()


def _add_recovery(trainer: pl.Trainer, context: WorkerContext, staging: str | None) -> None:
    """A fit that may restart: after a restart, the random states and (rank 0) what it wrote before;
    rank 0 sends checkpoints."""
    plan = context.recovery
    if plan is None or trainer.state.fn != namespaces.FITTING:
        return
    if plan.random_states is not None:
        trainer.callbacks.append(RestoreRandomStates(plan.random_states))
    low, high, policy = plan.elastic or (None, None, None)
    # Every rank: the batch policy at this size, and where an interrupted epoch goes on (data.elastic).
    trainer.callbacks.append(ElasticTraining(high, low, policy))
    if plan.from_memory:
        trainer.callbacks.append(MemorySnapshot(plan.attempt))  # what a restart goes on from (home.snapshot)
    elif plan.elastic:
        trainer.callbacks.append(LeavesWhenInterrupted())  # a grow in these processes, from the newest checkpoint
    # A sharded strategy's checkpoints take every rank.
    collective = bool(getattr(trainer.strategy, "collective_checkpoints", False))
    run = plan.storage_run
    tag = f"{plan.notice_key[-8:]}-{plan.attempt}"  # the folder of each recovery checkpoint in storage, with a count
    if context.rank.global_rank != 0:
        if collective:
            trainer.callbacks.append(RecoveryCheckpoints(plan.every_n_steps, None, True, run, tag))
        return
    if staging is not None and plan.seed is not None:
        files.seed(staging, ray.get(plan.seed))
    if plan.attempt > 0:
        loggers.continue_logs(trainer, plan.log_step)
    mirror = files.StagingMirror(staging, context.files_home) if staging is not None else None
    trainer.callbacks.append(RecoveryCheckpoints(plan.every_n_steps, mirror, collective, run, tag))


def _local_checkpoint(checkpoint: runtime.CheckpointFile, scratch: contextlib.ExitStack) -> str:
    """The path this worker reads the ``ckpt_path`` file (or sharded checkpoint's directory) from:
    the driver's, or a local copy of what it sent."""
    if checkpoint.data is None:
        return checkpoint.driver_path
    directory = scratch.enter_context(tempfile.TemporaryDirectory(prefix="ray_lightning-ckpt-"))
    path = os.path.join(directory, os.path.basename(checkpoint.driver_path.rstrip(os.sep)))
    data = ray.get(checkpoint.data)
    if isinstance(data, dict):
        for name, content in data.items():
            os.makedirs(os.path.dirname(os.path.join(path, name)), exist_ok=True)
            with open(os.path.join(path, name), "wb") as f:
                f.write(content)
    else:
        with open(path, "wb") as f:
            f.write(data)
    return path


def _set_environment(context: WorkerContext) -> None:
    update = {
        **context.env_vars,
        "LOCAL_RANK": str(context.rank.local_rank),
        "RANK": str(context.rank.global_rank),
        "NODE_RANK": str(context.rank.node_rank),
        "WORLD_SIZE": str(context.world_size),
        "LOCAL_WORLD_SIZE": str(context.rank.local_world_size),
        "MASTER_ADDR": context.main_address,
        "MASTER_PORT": str(context.main_port),
        # The device follows the GPUs Ray reserved: none means none visible.
        "CUDA_VISIBLE_DEVICES": context.cuda_visible_devices,
    }
    os.environ.update(update)
    # Ray numbers GPUs in PCI bus order; make CUDA's ordinals agree.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    context.torch_flags.apply()


# Code that is part of Python or of installed packages does not change between calls.
_INSTALLED = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def imported_code_files() -> dict[str, float]:
    """Modification time of every imported module file that is not Python's or an installed package's."""
    found = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and not path.startswith(_INSTALLED):
            found[path] = mtime(path)
    return found


def mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return -1.0
