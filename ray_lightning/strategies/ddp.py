"""``RayStrategy``: what Lightning sees — DDP whose processes are Ray actors.

Lightning's own DDP does the training work (wrapping the model, reducing gradients, collectives);
this class only changes where processes come from (:class:`~ray_lightning.launch.launcher.RayLauncher`),
where ranks come from (:class:`~ray_lightning.environment.RayEnvironment`) and how the process
group meets (a TCPStore opened by rank 0 on an OS-chosen port).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from lightning_fabric.utilities.seed import reset_seed
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from typing_extensions import override

from ray_lightning import _lightning, runtime
from ray_lightning.config import DEFAULT_PROGRESS_TIMEOUT_S, resolve_worker_resources
from ray_lightning.environment import RayEnvironment
from ray_lightning.strategies.workers import RayWorkersMixin

# DDPStrategy arguments that RayStrategy decides itself.
_RESERVED = ("accelerator", "parallel_devices", "cluster_environment", "start_method", "checkpoint_io")


class RayStrategy(RayWorkersMixin, DDPStrategy):
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
        worker_start_timeout_s: how long started actors may take to report in (import torch, ...),
            run ``init_hook`` and meet in the process group. Default 300 s, or
            ``RAY_LIGHTNING_WORKER_START_TIMEOUT_S``.
        keep_workers_alive_s: after a call succeeded, the workers wait this long for the next
            ``fit``/``test``/... of this process, which then starts at once (no new processes, no
            imports); they keep their resources meanwhile. 0 stops them after every call. Default
            60 s, or ``RAY_LIGHTNING_KEEP_WORKERS_ALIVE_S``; ``ray_lightning.release_idle_workers()``
            stops them now.
        progress_timeout_s: a rank that makes no progress (no batch of any loop, no step of setup)
            for this long stops the call with a ``WorkerHangError`` naming the stuck rank(s), their
            phase and every rank's Python stack. Default 900 s, or ``RAY_LIGHTNING_PROGRESS_TIMEOUT_S``
            (``none`` switches it off); None switches it off. The phases before training (start,
            ``init_hook``, rendezvous) are bounded by ``worker_start_timeout_s`` instead.
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
        keep_workers_alive_s: float | None = None,
        progress_timeout_s: float | None = DEFAULT_PROGRESS_TIMEOUT_S,
        **ddp_kwargs: Any,
    ) -> None:
        reserved = sorted(set(_RESERVED) & set(ddp_kwargs))
        if reserved:
            raise TypeError(f"RayStrategy sets {', '.join(reserved)} itself; do not pass them.")
        self._init_workers(
            resolve_worker_resources(num_workers, num_cpus_per_worker, use_gpu, resources_per_worker),
            init_hook,
            placement_timeout_s,
            worker_start_timeout_s,
            keep_workers_alive_s,
            progress_timeout_s,
        )
        # The arguments set here by name are the ones RayStrategy decides; naming them also keeps
        # LightningCLI/jsonargparse, which follows **ddp_kwargs into DDPStrategy, from offering them.
        super().__init__(
            accelerator=None,
            parallel_devices=None,
            cluster_environment=RayEnvironment(self.num_workers),
            checkpoint_io=None,
            start_method="popen",
            **ddp_kwargs,
        )

    @override
    def worker_process_group_backend(self) -> str:
        requested = self.requested_process_group_backend
        if requested:
            return requested
        if self.root_device.type == "cuda" and self._worker is not None and self._worker.shares_gpu:
            # NCCL refuses two ranks on one GPU (fractional GPUs); gloo handles CUDA tensors too.
            return "gloo"
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    @override
    def setup_distributed(self) -> None:
        runtime.mark_progress("rendezvous", "joining the process group", startup=True)
        reset_seed()
        self.set_world_ranks()
        backend = self.worker_process_group_backend()
        self.use_process_group_backend(backend)
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
        _lightning.init_dist_connection(self.cluster_environment, backend, **kwargs)
        runtime.mark_progress("setup", "prepare_data, setup hooks, configure_model")


if "ray" not in StrategyRegistry:
    StrategyRegistry.register("ray", RayStrategy, description="DDP on Ray actors (ray_lightning)")
