"""``RayStrategy``: what Lightning sees — DDP whose processes are Ray actors.

Lightning's own DDP does the training work (wrapping the model, reducing gradients, collectives);
this class only changes where processes come from (:class:`~ray_lightning.launcher.RayLauncher`),
where ranks come from (:class:`~ray_lightning.environment.RayEnvironment`) and how the process
group meets (a TCPStore opened by rank 0 on an OS-chosen port).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning_fabric.utilities.distributed import _init_dist_connection
from lightning_fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from pytorch_lightning.plugins.precision import MixedPrecision
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from pytorch_lightning.utilities.rank_zero import rank_zero_only, rank_zero_warn

from ray_lightning.environment import RayEnvironment
from ray_lightning.launcher import RayLauncher
from ray_lightning.resources import WorkerResources, resolve_worker_resources

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from ray_lightning.worker import WorkerContext

_DEFAULT_PLACEMENT_TIMEOUT_S = 60.0
_DEFAULT_WORKER_START_TIMEOUT_S = 300.0
# DDPStrategy arguments that RayStrategy decides itself.
_RESERVED = ("accelerator", "parallel_devices", "cluster_environment", "start_method", "checkpoint_io")


def _timeout(name: str, value: float | None, env: str, default: float) -> float:
    if value is None:
        value = float(os.environ.get(env, default))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}.")
    return float(value)


class RayStrategy(DDPStrategy):
    """PyTorch DDP across Ray actors, one actor per worker.

    Args:
        num_workers: number of training processes (Ray actors).
        num_cpus_per_worker: CPUs reserved for each worker.
        use_gpu: reserve one GPU per worker and train on CUDA with NCCL.
        resources_per_worker: Ray resources per worker, e.g. ``{"CPU": 2, "GPU": 0.5, "my_accel": 1}``.
            Wins over ``num_cpus_per_worker`` and ``use_gpu``; the device type follows the ``GPU``
            actually reserved.
        init_hook: called without arguments in every worker before training (set env vars, logging...).
        placement_timeout_s: how long to wait for the cluster to free the requested resources before
            failing with an error that says what was asked and what the cluster has. Default 60 s,
            or ``RAY_LIGHTNING_PLACEMENT_TIMEOUT_S``.
        worker_start_timeout_s: how long started actors may take to report in (import torch, ...).
            Default 300 s, or ``RAY_LIGHTNING_WORKER_START_TIMEOUT_S``.
        **ddp_kwargs: passed to Lightning's ``DDPStrategy`` and from there to
            ``DistributedDataParallel`` (``find_unused_parameters=True``, ``static_graph=True``, ...).

    Example::

        trainer = pl.Trainer(max_epochs=4, strategy=RayStrategy(num_workers=4, use_gpu=True))
        trainer.fit(model)  # the weights, metrics and best checkpoint are back here afterwards
    """

    strategy_name = "ray"

    def __init__(
        self,
        num_workers: int = 1,
        num_cpus_per_worker: float = 1,
        use_gpu: bool = False,
        resources_per_worker: Mapping[str, float] | None = None,
        init_hook: Callable[[], Any] | None = None,
        *,
        placement_timeout_s: float | None = None,
        worker_start_timeout_s: float | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        self.resources: WorkerResources = resolve_worker_resources(
            num_workers, num_cpus_per_worker, use_gpu, resources_per_worker
        )
        if init_hook is not None and not callable(init_hook):
            raise TypeError(f"init_hook must be a function taking no arguments, got {init_hook!r}.")
        reserved = sorted(set(_RESERVED) & set(ddp_kwargs))
        if reserved:
            raise TypeError(f"RayStrategy sets {', '.join(reserved)} itself; do not pass them.")
        self.init_hook = init_hook
        self.placement_timeout_s = _timeout(
            "placement_timeout_s",
            placement_timeout_s,
            "RAY_LIGHTNING_PLACEMENT_TIMEOUT_S",
            _DEFAULT_PLACEMENT_TIMEOUT_S,
        )
        self.worker_start_timeout_s = _timeout(
            "worker_start_timeout_s",
            worker_start_timeout_s,
            "RAY_LIGHTNING_WORKER_START_TIMEOUT_S",
            _DEFAULT_WORKER_START_TIMEOUT_S,
        )
        super().__init__(cluster_environment=RayEnvironment(self.resources.num_workers), **ddp_kwargs)
        self._worker: WorkerContext | None = None
        self._rendezvous_store: Any = None

    # -- configuration seen on the driver --------------------------------------------------------

    @property
    def num_workers(self) -> int:
        return self.resources.num_workers

    @property
    def use_gpu(self) -> bool:
        return self.resources.use_gpu

    @property
    def accelerator(self) -> pl.accelerators.Accelerator | None:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: pl.accelerators.Accelerator | None) -> None:
        # Lightning assigns the accelerator it chose from the driver's hardware; the workers'
        # reserved GPUs decide instead.
        self._accelerator = None if accelerator is None else self._accelerator_for_trainer(accelerator)

    def _prepare_for_trainer(self, requested: Any) -> pl.accelerators.Accelerator:
        """Called as a Trainer is built with this strategy: returns the accelerator it should use."""
        accelerator = self._accelerator_for_trainer(requested)
        # A strategy reused for another Trainer still holds what Lightning gave it last time, which
        # Lightning would take as conflicting flags.
        self._accelerator = None
        self.parallel_devices = None
        return accelerator

    def _accelerator_for_trainer(self, requested: Any) -> pl.accelerators.Accelerator:
        """What the Trainer should use when this strategy is given with ``accelerator=requested``."""
        from ray_lightning.accelerator import RayAccelerator

        if isinstance(requested, RayAccelerator):
            if requested._strategy is not None and requested._strategy is not self:
                raise ValueError(
                    "Pass either accelerator=RayAccelerator(...) or strategy=RayStrategy(...)/'ray', not both: "
                    "each describes the workers to start."
                )
            return requested
        name = requested if isinstance(requested, str) else type(requested).__name__
        wants_gpu = name.lower() in ("gpu", "cuda", "cudaaccelerator")
        wants_cpu = name.lower() in ("cpu", "cpuaccelerator")
        if (wants_gpu and not self.use_gpu) or (wants_cpu and self.use_gpu):
            rank_zero_warn(
                f"Trainer(accelerator={requested!r}) is ignored: RayStrategy trains on "
                f"{'CUDA' if self.use_gpu else 'CPU'} because the workers reserve "
                f"{self.resources.gpus:g} GPU each (use_gpu / resources_per_worker decide)."
            )
        return RayAccelerator._for_strategy(self)

    @property
    def cluster_environment(self) -> RayEnvironment:
        return self._cluster_environment

    @cluster_environment.setter
    def cluster_environment(self, env: Any) -> None:
        if env is not None and not isinstance(env, RayEnvironment):
            raise ValueError(
                f"RayStrategy computes ranks from where Ray placed its workers; it cannot use {type(env).__name__}."
            )
        self._cluster_environment = env

    @property
    def root_device(self) -> torch.device:
        if self._worker is not None and self._worker.device_index is not None:
            return torch.device("cuda", self._worker.device_index)
        return torch.device("cpu")

    @property
    def num_processes(self) -> int:
        return self.cluster_environment.local_world_size if self._worker is not None else self.num_workers

    @property
    def num_nodes(self) -> int:
        return self._worker.num_nodes if self._worker is not None else 1

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        # Ray decides how many nodes the workers span.
        if num_nodes != 1:
            rank_zero_warn(
                f"Trainer(num_nodes={num_nodes}) is ignored: RayStrategy places num_workers={self.num_workers} "
                "workers wherever the Ray cluster has room."
            )

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        self._launcher = RayLauncher(self)

    # -- inside a worker ----------------------------------------------------------------------------

    def _attach_worker(self, context: WorkerContext, rendezvous_store: Any) -> None:
        """Called by the worker actor before training with its rank, device and rank 0's store."""
        self._worker = context
        self._rendezvous_store = rendezvous_store
        self.cluster_environment.configure(context.rank, context.world_size, context.main_address, context.main_port)
        self.parallel_devices = [self.root_device] * context.rank.local_world_size
        plugin = self.precision_plugin
        if type(plugin) is MixedPrecision and plugin.device != self.root_device.type:
            # Lightning built it for the driver's device; a GradScaler made where CUDA is absent is
            # disabled for good, so build it anew for the device this worker trains on.
            self.precision_plugin = MixedPrecision(plugin.precision, self.root_device.type)

    def set_world_ranks(self) -> None:
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _get_process_group_backend(self) -> str:
        if self._process_group_backend:
            return self._process_group_backend
        if self.root_device.type == "cuda" and self._worker is not None and self._worker.shares_gpu:
            # NCCL refuses two ranks on one GPU (fractional GPUs); gloo handles CUDA tensors too.
            return "gloo"
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        store = self._rendezvous_store
        if store is None:
            from torch.distributed import TCPStore

            store = TCPStore(
                self.cluster_environment.main_address,
                self.cluster_environment.main_port,
                is_master=False,
                timeout=self._timeout or timedelta(minutes=30),
            )
        kwargs: dict[str, Any] = {"timeout": self._timeout, "store": store}
        if self.root_device.type == "cuda":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_rendezvous_store"] = None  # a TCPStore cannot be pickled; workers get theirs on attach
        return state


if "ray" not in StrategyRegistry:
    StrategyRegistry.register("ray", RayStrategy, description="DDP on Ray actors (ray_lightning)")
