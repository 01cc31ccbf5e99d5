"""What every ray_lightning strategy shares, whatever moves the gradients (DDP or Horovod).

:class:`RayWorkersMixin` goes first in a strategy's bases
(``class RayStrategy(RayWorkersMixin, DDPStrategy)``). It owns the description of the workers
(:class:`~ray_lightning.config.WorkerResources` and the time bounds), hands Lightning a
:class:`~ray_lightning.launch.launcher.RayLauncher` instead of a process launcher, keeps Lightning
from choosing devices by the driver's hardware, and, inside a worker, answers rank and device
questions from what the launcher decided (:meth:`RayWorkersMixin.attach_worker`). Lightning's
private hooks it needs are overridden in :class:`~ray_lightning._lightning.LightningStrategyHooks`.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import ray
import torch
from typing_extensions import override

from ray_lightning import _lightning, namespaces, runtime
from ray_lightning._lightning import LightningStrategyHooks
from ray_lightning.config import (
    DEFAULT_PROGRESS_TIMEOUT_S,
    RecoverySettings,
    WorkerResources,
    WorkerTimeouts,
    check_init_hook,
)
from ray_lightning.environment import RayEnvironment
from ray_lightning.launch.launcher import RayLauncher
from ray_lightning.launch.network import interface_for, listener_environment
from ray_lightning.launch.rendezvous import Rendezvous, TorchStoreRendezvous
from ray_lightning.runtime import WorkerContext
from ray_lightning.strategies.accelerator import RayAccelerator

if TYPE_CHECKING:
    import pytorch_lightning as pl


# The constructor arguments every strategy's workers share (RayWorkersMixin._init_workers).
WORKER_ARGUMENTS = (
    "init_hook",
    "placement_timeout_s",
    "worker_start_timeout_s",
    "keep_workers_alive_s",
    "progress_timeout_s",
    "scale_up_timeout_s",
    "max_failures",
    "recovery_checkpoint_every_n_steps",
)


class RayWorkersMixin(LightningStrategyHooks):
    """Workers on Ray actors for a Lightning ``ParallelStrategy`` subclass; see the module docstring."""

    # The accelerator the Trainer gets with this strategy (the classic form of the same workers).
    accelerator_class: type[RayAccelerator] = RayAccelerator
    # A Trainer of the other Lightning namespace uses a rebuild of this strategy: the caller's object
    # shows its restarts too (namespaces.rebuild_for).
    shared_with_rebuild = ("restarts",)
    _cluster_environment: RayEnvironment | None
    # Set on each family member (ray_lightning.namespaces.family): the Lightning it subclasses.
    namespace: namespaces.Namespace
    init_arguments: dict[str, Any]

    def _init_workers(
        self,
        resources: WorkerResources,
        init_hook: Callable[[], Any] | None,
        *,
        placement_timeout_s: float | None = None,
        worker_start_timeout_s: float | None = None,
        keep_workers_alive_s: float | None = None,
        progress_timeout_s: float | None = DEFAULT_PROGRESS_TIMEOUT_S,
        scale_up_timeout_s: float | None = None,
        max_failures: int | None = None,
        recovery_checkpoint_every_n_steps: int | None = None,
    ) -> None:
        """Validate and keep the worker description; call before the Lightning strategy's ``__init__``."""
        check_init_hook(init_hook)
        timeouts = WorkerTimeouts.resolve(
            placement_timeout_s, worker_start_timeout_s, keep_workers_alive_s, progress_timeout_s, scale_up_timeout_s
        )
        self.resources = resources
        self.init_hook = init_hook
        self.placement_timeout_s = timeouts.placement_s
        self.worker_start_timeout_s = timeouts.start_s
        self.keep_workers_alive_s = timeouts.keep_alive_s
        self.progress_timeout_s = timeouts.progress_s
        self.scale_up_timeout_s = timeouts.scale_up_s
        self.recovery = RecoverySettings.resolve(max_failures, recovery_checkpoint_every_n_steps)
        # Every restart of this strategy's workers inside its calls (ray_lightning.launch.recovery.Restart).
        self.restarts: list[Any] = []
        self._worker: WorkerContext | None = None
        self._rendezvous_store: Any = None

    def init_workers_from(self, resources: WorkerResources, arguments: dict[str, Any]) -> None:
        """:meth:`_init_workers` with the constructor's own arguments (its ``locals()``); those a strategy
        does not take keep their defaults."""
        self._init_workers(resources, **{k: arguments[k] for k in WORKER_ARGUMENTS if k in arguments})

    @property
    def max_failures(self) -> int:
        """How many times one call may restart its workers (``max_failures``)."""
        return self.recovery.max_failures

    def keep_init_arguments(self, arguments: dict[str, Any], var_keyword: dict[str, Any]) -> None:
        """Keep the constructor's arguments (from its ``locals()``): a Trainer of the other Lightning
        namespace rebuilds this strategy from them (:func:`ray_lightning.namespaces.rebuild_for`)."""
        parameters = inspect.signature(type(self).__init__).parameters.values()
        named = [p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"]
        self.init_arguments = {**{name: arguments[name] for name in named}, **var_keyword}

    def warn(self, message: str) -> None:
        """Warn once, from rank 0, as Lightning does."""
        self.namespace.pl("utilities.rank_zero.rank_zero_warn")(message)

    @classmethod
    def accepted_keywords(cls) -> set[str]:
        """The keyword arguments this strategy's constructor takes (``RayAccelerator`` checks its own against them)."""
        parameters = inspect.signature(cls.__init__).parameters.items()
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return {name for name, p in parameters if p.kind in named and name != "self"}

    # -- configuration seen on the driver --------------------------------------------------------

    @property
    def num_workers(self) -> int:
        return self.resources.num_workers

    @property
    def use_gpu(self) -> bool:
        return self.resources.use_gpu

    @property
    def num_cpus_per_worker(self) -> float:
        """CPUs each worker reserves (``resources_per_worker['CPU']`` when given), as in ray_lightning 0.3."""
        return self.resources.cpus

    @property
    def num_gpus_per_worker(self) -> float:
        """GPUs each worker reserves (0, a fraction, or whole GPUs), as in ray_lightning 0.3."""
        return self.resources.gpus

    @property
    def rendezvous(self) -> Rendezvous:
        """How this strategy's workers meet: torch.distributed's TCPStore, opened by rank 0."""
        return TorchStoreRendezvous()

    @override
    def make_launcher(self) -> RayLauncher:
        return RayLauncher(self)

    def check_trainer(self, trainer: pl.Trainer) -> None:
        """Refuse, on the driver and before any worker starts, a Trainer this strategy cannot run."""

    @override
    def choose_accelerator(self, accelerator: Any) -> RayAccelerator:
        # Lightning assigns the accelerator it chose from the driver's hardware; the workers'
        # reserved GPUs decide instead.
        return self._accelerator_for_trainer(accelerator)

    def prepare_for_trainer(self, requested: Any) -> RayAccelerator:
        """Called as a Trainer is built with this strategy: returns the accelerator it should use."""
        accelerator = self._accelerator_for_trainer(requested)
        # A strategy reused for another Trainer still holds what Lightning gave it last time, which
        # Lightning would take as conflicting flags.
        self.forget_accelerator()
        self.parallel_devices = None
        return accelerator

    def _accelerator_for_trainer(self, requested: Any) -> RayAccelerator:
        """What the Trainer should use when this strategy is given with ``accelerator=requested``."""
        if isinstance(requested, RayAccelerator):
            if not requested.belongs_to(self):
                raise ValueError(
                    f"Pass either accelerator={type(requested).__name__}(...) or strategy="
                    f"{type(self).__name__}(...), not both: each describes the workers to start."
                )
            return requested
        name = requested if isinstance(requested, str) else type(requested).__name__
        wants_gpu = name.lower() in ("gpu", "cuda", "cudaaccelerator")
        wants_cpu = name.lower() in ("cpu", "cpuaccelerator")
        if (wants_gpu and not self.use_gpu) or (wants_cpu and self.use_gpu):
            self.warn(
                f"Trainer(accelerator={requested!r}) is ignored: {type(self).__name__} trains on "
                f"{'CUDA' if self.use_gpu else 'CPU'} because the workers reserve "
                f"{self.resources.gpus:g} GPU each (use_gpu / resources_per_worker decide)."
            )
        return namespaces.sibling(self.accelerator_class, self.namespace).for_strategy(self)

    @property
    def cluster_environment(self) -> RayEnvironment | None:
        return self._cluster_environment

    @cluster_environment.setter
    def cluster_environment(self, env: Any) -> None:
        if env is not None and not isinstance(env, RayEnvironment):
            raise ValueError(
                f"{type(self).__name__} computes ranks from where Ray placed its workers; "
                f"it cannot use {type(env).__name__}."
            )
        self._cluster_environment = env

    @property
    @override
    def root_device(self) -> torch.device:
        if self._worker is not None and self._worker.device_index is not None:
            return torch.device("cuda", self._worker.device_index)
        return torch.device("cpu")

    @property
    @override
    def num_processes(self) -> int:
        if self._worker is not None and self._cluster_environment is not None:
            return self._cluster_environment.local_world_size
        return self.num_workers

    @property
    @override
    def num_nodes(self) -> int:
        return self._worker.num_nodes if self._worker is not None else 1

    @num_nodes.setter
    @override
    def num_nodes(self, num_nodes: int) -> None:
        # Ray decides how many nodes the workers span.
        if num_nodes != 1:
            self.warn(
                f"Trainer(num_nodes={num_nodes}) is ignored: {type(self).__name__} places "
                f"{self.resources.describe()} wherever the Ray cluster has room."
            )

    @property
    @override
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # -- inside a worker ----------------------------------------------------------------------------

    def attach_worker(self, context: WorkerContext, rendezvous_store: Any) -> None:
        """Called by the worker before the call with its rank, device and rendezvous handle."""
        self._worker = context
        self._rendezvous_store = rendezvous_store
        assert self._cluster_environment is not None
        self._cluster_environment.configure(context.rank, context.world_size, context.main_address, context.main_port)
        self.parallel_devices = [self.root_device] * context.rank.local_world_size
        plugin = self.precision_plugin
        mixed_precision = self.namespace.pl("plugins.precision.MixedPrecision")
        if type(plugin) is mixed_precision and plugin.device != self.root_device.type:
            # Lightning built it for the driver's device; a GradScaler made where CUDA is absent is
            # disabled for good, so build it anew for the device this worker trains on.
            self.precision_plugin = mixed_precision(plugin.precision, self.root_device.type)

    def detach_worker(self) -> None:
        """Called by the worker after a call succeeded: leave the process group, so that the
        process can join the next call's."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self._worker = None
        self._rendezvous_store = None

    @override
    def worker_process_group_backend(self) -> str:
        requested = self.requested_process_group_backend
        if requested:
            return requested
        if self.root_device.type == "cuda" and self._worker is not None and self._worker.shares_gpu:
            # NCCL refuses two ranks on one GPU (fractional GPUs); gloo handles CUDA tensors too.
            return "gloo"
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    def join_process_group(self) -> None:
        """In a worker: join the call's torch.distributed process group at rank 0's rendezvous (TCPStore)."""
        runtime.mark_progress("rendezvous", "joining the process group", startup=True)
        self.namespace.fabric("utilities.seed.reset_seed")()
        self.set_world_ranks()
        backend = self.worker_process_group_backend()
        self.use_process_group_backend(backend)
        # gloo's (and NCCL's bootstrap) listeners bind this node's IP; the call's environment is
        # restored when it ends.
        interface = interface_for(ray.util.get_node_ip_address())
        os.environ.update(listener_environment(backend, interface, os.environ))
        store = self._rendezvous_store
        if store is None:
            from torch.distributed import TCPStore

            store = TCPStore(
                self.cluster_environment.main_address,
                self.cluster_environment.main_port,
                is_master=False,
                timeout=self.ddp_timeout or timedelta(minutes=30),
            )
        kwargs: dict[str, Any] = {"timeout": self.ddp_timeout, "store": store}
        if self.root_device.type == "cuda":
            kwargs["device_id"] = self.root_device
        _lightning.init_dist_connection(self.namespace, self.cluster_environment, backend, **kwargs)

    @override
    def set_world_ranks(self) -> None:
        for fabric in (False, True):
            namespaces.set_everywhere("utilities.rank_zero.rank_zero_only", "rank", self.global_rank, fabric=fabric)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_rendezvous_store"] = None  # a TCPStore cannot be pickled; workers get theirs on attach
        return state
