"""``RayLauncher``: starts the worker actors, wires up their ranks, returns the results.

This is what Lightning calls instead of re-running ``sys.argv`` (``ddp``) or forking (``ddp_spawn``).
For every ``fit``/``validate``/``test``/``predict`` it

1. connects to Ray (a local one is started if none is running),
2. takes the workers the last call of this process left waiting, if they match
   (:mod:`ray_lightning.idle_workers`); otherwise checks that the cluster can hold the request,
   reserves it as one placement group (a bundle per worker, or per host with ``num_hosts``),
   waiting at most ``placement_timeout_s``, and starts one :class:`~ray_lightning.worker.RayWorker`
   per worker in those bundles,
3. puts the Trainer, the module and the arguments into the object store once,
4. learns where each worker landed and assigns ranks and GPUs (:mod:`ray_lightning.environment`);
   rank 0 opens the rendezvous the strategy asks for (a TCPStore for DDP, Horovod's Gloo
   rendezvous for Horovod),
5. waits for all of them without polling, meanwhile running what rank 0 sends to the driver
   (:mod:`ray_lightning.driver_channel`: the progress bar, Tune reports); the first failure stops
   the group and is raised with its rank and traceback,
6. copies rank 0's results and files onto the driver's Trainer (:mod:`ray_lightning.results`,
   :mod:`ray_lightning.driver_files`),
7. leaves the workers waiting for the next call (``keep_workers_alive_s``), or stops them.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray
import torch
from pytorch_lightning.callbacks import ModelCheckpoint, TQDMProgressBar
from pytorch_lightning.strategies.launchers.launcher import _Launcher
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import (
    get_current_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_lightning import driver_files, idle_workers
from ray_lightning.driver_channel import DriverChannel, needs_channel
from ray_lightning.environment import WorkerRank, assign_cuda_devices, assign_ranks, shares_a_gpu
from ray_lightning.resources import (
    ClusterResourceError,
    WorkerResources,
    check_cluster_can_hold,
    describe_totals,
)
from ray_lightning.results import WorkerOutput, apply_to_driver, merge_predictions
from ray_lightning.worker import NodeInfo, RayWorker, WorkerContext

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from ray_lightning.strategy_base import RayWorkersMixin

log = logging.getLogger(__name__)

# Environment variables of the driver that Lightning reads in the workers (seed, deterministic flags).
_FORWARDED_ENV_PREFIXES = ("PL_", "CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED")
# How long to look for a dead worker behind another worker's exception.
_DEATH_GRACE_S = 2.0


class RayWorkerError(RuntimeError):
    """A worker raised or died. ``rank`` is its global rank; the message holds its traceback."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self) -> tuple:
        # Tune copies and Ray pickles exceptions; keep the rank when they do.
        return (type(self), (str(self), self.rank))


def ensure_ray_initialized() -> None:
    """Use the Ray this process is connected to, else ``RAY_ADDRESS``'s cluster, else start a local one."""
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"))


def _driver_node_id() -> str | None:
    """The Ray node this process runs on; None for a Ray Client, whose machine is no node of the cluster."""
    if ray.util.client.ray.is_connected():
        return None
    return ray.get_runtime_context().get_node_id()


def _driver_sys_path() -> tuple[str, ...]:
    """Where this process imports from, for workers on its machine (a Ray Client's paths mean nothing there)."""
    if ray.util.client.ray.is_connected():
        return ()
    # "" is the working directory (notebooks, `python -c`); workers have their own.
    return tuple(os.path.abspath(p) if p == "" else p for p in sys.path)


class RayLauncher(_Launcher):
    """Runs a Trainer function on Ray actors; see the module docstring for the steps."""

    def __init__(self, strategy: RayWorkersMixin) -> None:
        self._strategy = strategy
        self._group: _WorkerGroup | None = None
        # (rank 0's node id, staging directory name) while a call whose rank 0 stages its files runs.
        self._staging: tuple[str, str] | None = None
        # Checkpoint files the last launch copied from rank 0's node onto the driver's machine.
        self.transferred_files: list[str] = []

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        strategy = self._strategy
        request = strategy.resources
        if trainer is not None:
            strategy._check_trainer(trainer)
        ensure_ray_initialized()
        enclosing = get_current_placement_group()
        if trainer is not None:
            for logger in trainer.loggers:
                # Fix the version (e.g. lightning_logs/version_3) here, so rank 0 writes where
                # `trainer.logger.log_dir` points on the driver afterwards.
                _ = logger.version
            driver_files.make_absolute(trainer)
        payload = _put_payload(trainer, function, args, kwargs)
        checkpoint = _checkpoint_argument(function, args, kwargs, trainer)

        group = idle_workers.take(request) if enclosing is None else None
        if group is None:
            if enclosing is not None:
                group = _WorkerGroup.start_in(enclosing, request)
            else:
                check_cluster_can_hold(request, [n["Resources"] for n in ray.nodes() if n.get("Alive")])
                group = _WorkerGroup.start(request, strategy.placement_timeout_s)
        self._group = group
        self._staging = None
        succeeded = False
        try:
            channel = group.channel() if trainer is not None and _needs_channel(trainer) else None
            infos = group.node_infos(strategy.worker_start_timeout_s)
            outputs = group.run(payload, self._contexts(group, infos, channel, checkpoint), channel)
            if channel is not None:
                channel.run_remaining()
            succeeded = True
        finally:
            self._group = None
            if succeeded and group.owns_pg and strategy.keep_workers_alive_s > 0:
                idle_workers.keep(request, group, strategy.keep_workers_alive_s)
            else:
                group.shutdown()
            if not succeeded and self._staging is not None:
                self._fetch_staged_files()

        rank_zero = next(o for o in outputs if o is not None and o.trainer_state is not None)
        if trainer is None:
            return rank_zero.results
        apply_to_driver(trainer, rank_zero)
        self.transferred_files = sorted(rank_zero.files)
        if self.transferred_files:
            log.info("ray_lightning: copied %s from rank 0's node to this machine", ", ".join(self.transferred_files))
        if trainer.state.fn == TrainerFn.PREDICTING:
            if not rank_zero.return_predictions:
                return None
            per_rank = [o.predictions or [] for o in outputs if o is not None]
            return merge_predictions(per_rank, rank_zero.num_predict_dataloaders)
        return rank_zero.results

    def _contexts(
        self,
        group: _WorkerGroup,
        infos: list[NodeInfo],
        channel: DriverChannel | None = None,
        checkpoint: str | None = None,
    ) -> list[WorkerContext]:
        """Each worker's rank, device and rendezvous, from where the actors landed."""
        node_ids = [i.node_id for i in infos]
        gpu_ids = [i.gpu_ids for i in infos]
        ranks = group.ranks
        devices = assign_cuda_devices(node_ids, gpu_ids)
        shared = shares_a_gpu(node_ids, gpu_ids)
        rank_zero = infos[0]  # assign_ranks always gives actor 0 global rank 0
        nodes_by_rank = [node for _, node in sorted(zip((r.global_rank for r in ranks), node_ids))]
        port, rank_env = group.open_rendezvous(
            self._strategy._rendezvous, nodes_by_rank, self._strategy.worker_start_timeout_s
        )
        driver_node = _driver_node_id()
        # Rank 0 off the driver's machine writes into a staging directory of this name on its node.
        self._staging = None
        if infos[0].node_id != driver_node:
            self._staging = (infos[0].node_id, f"ray_lightning-staging-{uuid.uuid4().hex[:12]}")
        # Workers on this machine read the file where it is, by its absolute path (their working
        # directory is not the driver's).
        local = (checkpoint, None) if checkpoint is not None else None
        shipped = None
        if checkpoint is not None and any(i.node_id != driver_node for i in infos):
            # Workers on other machines may not see the driver's file: send it once through the
            # object store; each of them writes it locally before Lightning reads it.
            with open(checkpoint, "rb") as f:
                shipped = (checkpoint, ray.put(f.read()))
        env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV_PREFIXES)}
        sys_path = _driver_sys_path()
        # Trainer(deterministic=..., benchmark=...) set these in this process only.
        torch_flags = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.benchmark,
        )
        num_nodes = len(set(node_ids))
        placed = ", ".join(
            f"rank {r.global_rank} on {i.node_ip} (node {i.node_id[:8]}, pid {i.pid}, "
            f"GPUs {','.join(i.gpu_ids) or 'none'})"
            for r, i in sorted(zip(ranks, infos), key=lambda p: p[0].global_rank)
        )
        reused = " (reusing the workers of the last call)" if group.calls else ""
        rank_zero_info(
            f"ray_lightning: {self._strategy.resources.describe()} on {num_nodes} node(s){reused}: {placed}"
        )
        return [
            WorkerContext(
                rank=rank,
                world_size=len(infos),
                num_nodes=num_nodes,
                main_address=rank_zero.node_ip,
                main_port=port,
                cuda_visible_devices=visible,
                device_index=index,
                shares_gpu=shared,
                staging_name=self._staging[1] if self._staging and rank.global_rank == 0 else None,
                env_vars={**env, **rank_env[rank.global_rank]},
                driver_sys_path=sys_path if info.node_id == driver_node else (),
                torch_flags=torch_flags,
                driver_queue=channel.queue if channel is not None else None,
                checkpoint_file=shipped if info.node_id != driver_node else local,
            )
            for rank, info, (visible, index) in zip(ranks, infos, devices)
        ]

    def _fetch_staged_files(self) -> None:
        """After a failure: copy what rank 0 had written on its node (checkpoints, logs) to the driver."""
        assert self._staging is not None
        node_id, name = self._staging
        self._staging = None
        try:
            written = driver_files.fetch_after_failure(node_id, name, self._strategy.worker_start_timeout_s)
        except Exception as error:  # noqa: BLE001 - the node may be gone; the failure itself is what matters
            log.warning("ray_lightning: could not fetch the files rank 0 wrote before the failure: %s", error)
            return
        self.transferred_files = written
        if written:
            log.warning("ray_lightning: copied what rank 0 wrote before the failure: %s", ", ".join(written))

    def kill(self, signum: Any) -> None:
        if self._group is not None:
            self._group.shutdown()

    def __getstate__(self) -> dict:
        # Shipped to the workers inside the Trainer: actor handles stay on the driver.
        state = self.__dict__.copy()
        state["_group"] = state["_staging"] = None
        return state


def _checkpoint_argument(function: Callable, args: tuple, kwargs: dict, trainer: pl.Trainer | None) -> str | None:
    """The checkpoint file on this machine that ``fit``/``validate``/... were given, if any.

    ``"best"``/``"last"`` name the checkpoint callback's file, which is on this machine (copied
    back from rank 0's node), not necessarily on the workers' machines.
    """
    try:
        path = inspect.signature(function).bind_partial(*args, **kwargs).arguments.get("ckpt_path")
    except (TypeError, ValueError):
        return None
    callback = trainer.checkpoint_callback if trainer is not None else None
    if path in ("best", "last") and isinstance(callback, ModelCheckpoint):
        path = callback.best_model_path if path == "best" else callback.last_model_path
    if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
        return os.path.abspath(path)
    return None  # None, a remote URL, "best" without a file...: resolved by Lightning in the workers


def _needs_channel(trainer: pl.Trainer) -> bool:
    """Whether rank 0 will send calls to the driver: Tune reports, or the progress bar the driver draws."""
    return needs_channel(trainer.callbacks) or isinstance(trainer.progress_bar_callback, TQDMProgressBar)


def _put_payload(trainer: pl.Trainer | None, function: Callable, args: tuple, kwargs: dict) -> ray.ObjectRef:
    """Serialize the Trainer, module and arguments once; every worker reads the same object."""
    try:
        return ray.put((trainer, function, args, kwargs))
    except Exception as error:
        culprit = _find_unserializable(trainer, args, kwargs)
        raise TypeError(
            f"ray_lightning could not send the training job to the Ray workers: {culprit or error}. "
            "Everything reachable from the LightningModule, DataModule, callbacks and loggers must be picklable; "
            "create such objects (locks, open files, clients) in `setup()` instead of `__init__()`."
        ) from error


def _find_unserializable(trainer: pl.Trainer | None, args: tuple, kwargs: dict) -> str | None:
    candidates: list[tuple[str, Any]] = []
    if trainer is not None and trainer.lightning_module is not None:
        candidates.append((type(trainer.lightning_module).__name__, trainer.lightning_module))
    candidates += [(f"argument {i}", a) for i, a in enumerate(args) if a is not None]
    candidates += [(f"argument {k!r}", v) for k, v in kwargs.items() if v is not None]
    if trainer is not None:
        candidates += [(type(cb).__name__, cb) for cb in trainer.callbacks]
        candidates += [(type(lg).__name__, lg) for lg in trainer.loggers]
    for label, obj in candidates:
        found = _deepest_unpicklable(obj, label, depth=0)
        if found:
            return found
    return None


_MODULE_CONTAINERS = ("_modules", "_parameters", "_buffers")


def _deepest_unpicklable(obj: Any, path: str, depth: int) -> str | None:
    """The most specific attribute path under ``obj`` that cloudpickle refuses, or None."""
    from ray import cloudpickle

    try:
        cloudpickle.dumps(obj)
        return None
    except Exception as error:  # noqa: BLE001 - any pickling failure is what we look for
        reason = f"{type(error).__name__}: {error}"
    children: list[tuple[str, Any]] = []
    if depth < 6:
        if isinstance(obj, dict):
            children = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set)):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif hasattr(obj, "__dict__"):
            for name, value in vars(obj).items():
                if name in _MODULE_CONTAINERS and isinstance(value, dict):
                    children += [(f"{path}.{k}", v) for k, v in value.items()]
                else:
                    children.append((f"{path}.{name}", value))
    for child_path, child in children:
        found = _deepest_unpicklable(child, child_path, depth + 1)
        if found:
            return found
    return f"{path} cannot be pickled ({reason})"


class _WorkerGroup:
    """The placement group and the actors of one launch."""

    def __init__(self, pg: Any, actors: list[Any], ranks: list[WorkerRank], owns_pg: bool = True) -> None:
        self.pg = pg
        self.owns_pg = owns_pg
        self.actors = actors
        self.ranks = ranks
        self.infos: list[NodeInfo] = []
        self.calls = 0  # calls run so far: more than 0 when the group is reused
        self._channel: DriverChannel | None = None
        self._session = _ray_session()

    def in_current_session(self) -> bool:
        """Whether the Ray this group was started in is still the one this process is connected to."""
        return ray.is_initialized() and _ray_session() == self._session

    def channel(self) -> DriverChannel:
        """The queue workers send driver calls through; made on first use, kept as long as the group."""
        if self._channel is None:
            self._channel = DriverChannel()
        return self._channel

    @classmethod
    def start_in(cls, pg: Any, request: WorkerResources) -> _WorkerGroup:
        """Start the workers in bundles of a placement group the caller already runs in (a Tune trial's).

        Bundle 0 is the caller's own; the workers take the first later bundles that can each hold
        one worker. The group does not own the placement group and leaves it in place.
        """
        if request.num_hosts:
            raise ClusterResourceError(
                "num_hosts/num_slots cannot be used inside a placement group (e.g. a Ray Tune trial), whose "
                "bundles are already placed; use num_workers."
            )
        need = request.bundle()
        specs = pg.bundle_specs
        fitting = [i for i, spec in enumerate(specs) if i > 0 and all(spec.get(k, 0) >= v for k, v in need.items())]
        if len(fitting) < request.num_workers:
            reserved = ", ".join(describe_totals(spec) for spec in specs)
            raise ClusterResourceError(
                f"This fit runs inside a placement group (a Ray Tune trial's) that reserved [{reserved}]: "
                f"bundle 0 for the trial itself and {len(fitting)} that can each hold a worker, but it needs "
                f"{request.describe()}. Reserve them with resources_per_trial=ray_lightning.tune.get_tune_resources("
                "num_workers=..., num_cpus_per_worker=..., use_gpu=..., resources_per_worker=...) "
                "(or tune.with_resources(train_fn, get_tune_resources(...)))."
            )
        bundles = fitting[: request.num_workers]
        bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
        return cls._start_actors(pg, request, bundles, [bundle_nodes[b] for b in bundles], owns_pg=False)

    @classmethod
    def start(cls, request: WorkerResources, timeout_s: float) -> _WorkerGroup:
        bundles, placement = request.placement()
        pg = placement_group(bundles, strategy=placement)
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except GetTimeoutError:
            remove_placement_group(pg)
            raise ClusterResourceError(
                f"Could not reserve {request.describe()} within {timeout_s:g} s "
                f"(placement_timeout_s). The cluster has {describe_totals(ray.cluster_resources())}, "
                f"of which {describe_totals(ray.available_resources())} are free now; other jobs or "
                "trials may hold the rest. Use fewer workers, wait for them to finish, or raise "
                "placement_timeout_s."
            ) from None
        except BaseException:
            remove_placement_group(pg)
            raise
        bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
        bundles = [request.bundle_index(i) for i in range(request.num_workers)]
        return cls._start_actors(pg, request, bundles, [bundle_nodes[b] for b in bundles], owns_pg=True)

    @classmethod
    def _start_actors(
        cls, pg: Any, request: WorkerResources, bundles: list[int], nodes: list[str], owns_pg: bool
    ) -> _WorkerGroup:
        """One actor per worker in ``bundles`` (placed on ``nodes``)."""
        # Ranks follow the nodes the bundles were placed on, so each actor knows its rank from the
        # start (Ray prefixes its log lines with it).
        ranks = assign_ranks(nodes)
        remote = ray.remote(RayWorker)
        group = cls(pg, [], ranks, owns_pg)
        try:
            for bundle, rank in zip(bundles, ranks):
                strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
                options = request.actor_options()
                group.actors.append(remote.options(**options, scheduling_strategy=strategy).remote(rank.global_rank))
        except BaseException:
            group.shutdown()
            raise
        return group

    def node_infos(self, timeout_s: float) -> list[NodeInfo]:
        if not self.infos:  # a reused group's actors are where they were
            self.infos = self._get([a.node_info.remote() for a in self.actors], timeout_s, "report where they run")
        return self.infos

    def open_rendezvous(self, kind: str, nodes_by_rank: list[str], timeout_s: float) -> tuple[int, list[dict]]:
        """Have rank 0 open the rendezvous; returns its port and each rank's extra environment."""
        rank_zero = self.actors[next(i for i, r in enumerate(self.ranks) if r.global_rank == 0)]
        ref = rank_zero.open_rendezvous.remote(kind, nodes_by_rank, timeout_s)
        return self._get([ref], timeout_s, "open the rendezvous")[0]

    def _get(self, refs: list[Any], timeout_s: float, what: str) -> list[Any]:
        try:
            return ray.get(refs, timeout=timeout_s)
        except GetTimeoutError:
            raise TimeoutError(
                f"ray_lightning: the worker actors did not {what} within {timeout_s:g} s "
                "(worker_start_timeout_s); a worker process may be stuck starting or importing."
            ) from None
        except RayActorError as error:
            raise RayWorkerError(f"A ray_lightning worker died while starting: {error}", rank=-1) from error

    def run(
        self, payload: ray.ObjectRef, contexts: list[WorkerContext], channel: DriverChannel | None = None
    ) -> list[WorkerOutput | None]:
        """Run every worker; return their outputs in actor order, or raise the first failure.

        Calls the workers send through ``channel`` run here as they arrive.
        """
        self.calls += 1
        refs = [actor.execute.remote([payload], ctx) for actor, ctx in zip(self.actors, contexts)]
        pending = {ref: i for i, ref in enumerate(refs)}
        outputs: list[WorkerOutput | None] = [None] * len(refs)
        while pending:
            # Blocks until some worker finishes or fails, or sends a call: no polling, no timeout
            # on training itself.
            waiting = list(pending) if channel is None else [*pending, channel.next_call()]
            done, _ = ray.wait(waiting, num_returns=1)
            if channel is not None and channel.next_call() in done:
                channel.run_next()
                continue
            for ref in done:
                i = pending.pop(ref)
                try:
                    outputs[i] = ray.get(ref)
                except RayActorError as error:
                    raise self._failure(i, contexts[i], error, died=True) from None
                except RayTaskError as error:
                    self._raise_death_behind(pending, contexts)
                    raise self._failure(i, contexts[i], error, died=False) from _cause(error)
        for actor in self.actors:
            actor.finish_call.remote()  # clean up for the next call while the driver goes on
        return outputs

    def _raise_death_behind(self, pending: dict[Any, int], contexts: list[WorkerContext]) -> None:
        """When a worker dies, its peers' collectives fail at about the same moment; blame the dead one.

        Waits at most ``_DEATH_GRACE_S`` for another worker's result, and raises that worker's
        death if it died.
        """
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_DEATH_GRACE_S)
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError as error:
                i = pending[ref]
                raise self._failure(i, contexts[i], error, died=True) from None
            except Exception:  # noqa: BLE001 - only deaths matter here
                pass

    def _failure(self, i: int, context: WorkerContext, error: Exception, died: bool) -> RayWorkerError:
        info = self.infos[i] if i < len(self.infos) else None
        where = f"node {info.node_ip}, pid {info.pid}" if info else "unknown node"
        rank = context.rank.global_rank
        if died:
            message = (
                f"ray_lightning worker rank {rank} ({where}) died unexpectedly (killed, out of memory, or "
                f"its node failed): {error}. All workers have been stopped."
            )
        else:
            trace = getattr(error, "traceback_str", None) or str(error)
            message = (
                f"ray_lightning worker rank {rank} ({where}) raised an exception. "
                f"All workers have been stopped.\n{trace}"
            )
        return RayWorkerError(message, rank=rank)

    def shutdown(self) -> None:
        if not self.in_current_session():
            # Its Ray is gone, and the actors with it. Ray calls now would start a new local Ray.
            self.actors, self._channel = [], None
            return
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.owns_pg:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
        self.actors = []


def _ray_session() -> str | None:
    """Identifies the Ray session this process is connected to (None if none)."""
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    return f"{context.gcs_address}/{context.get_job_id()}"


def _cause(error: RayTaskError) -> BaseException | None:
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else None
