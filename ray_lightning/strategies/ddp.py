"""``RayStrategy``: what Lightning sees — DDP whose processes are Ray actors.

Lightning's own DDP does the training work (wrapping the model, reducing gradients, collectives);
this class only changes where processes come from (:class:`~ray_lightning.launch.launcher.RayLauncher`),
where ranks come from (:class:`~ray_lightning.environment.RayEnvironment`) and how the process
group meets (a TCPStore opened by rank 0 on its node IP and an OS-chosen port; gloo's listeners on
each worker's node IP interface).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from typing_extensions import override

from ray_lightning import runtime
from ray_lightning._torch import allreduce_wait_probe
from ray_lightning.config.arguments import check_keywords, refuse_decided
from ray_lightning.config.resources import WorkerResources
from ray_lightning.strategies import accelerator
from ray_lightning.strategies.arguments import worker_arguments
from ray_lightning.strategies.workers import RayWorkersMixin

# Arguments of DDPStrategy and DistributedDataParallel that RayStrategy (or Lightning in the
# worker) decides, and why.
_DECIDED = {
    "accelerator": "from the GPUs the workers reserve",
    "parallel_devices": "from the GPUs the workers reserve",
    "cluster_environment": "from where Ray placed the workers",
    "start_method": "Ray starts the processes",
    "checkpoint_io": "from Trainer(plugins=[...])",
    "module": "Lightning wraps the LightningModule",
    "device_ids": "each worker's device",
    "process_group": "process groups exist only in the workers; choose its backend with process_group_backend",
    "device_mesh": "process groups exist only in the workers",
}


def _check_ddp_kwargs(strategy: type, ddp_kwargs: Mapping[str, Any], resources: WorkerResources) -> dict[str, Any]:
    """Refuse, here on the driver, what would otherwise fail in every worker once they started.

    Returns the arguments to pass on: those RayStrategy decides are dropped when they are None
    (LightningCLI/jsonargparse passes every DDP argument with its default, ``process_group=None``...).
    """
    ddp_kwargs = refuse_decided("RayStrategy", ddp_kwargs, _DECIDED)
    check_keywords(
        "RayStrategy",
        ddp_kwargs,
        strategy.accepted_keywords(),
        "its own arguments and those of Lightning's DDPStrategy and torch's DistributedDataParallel",
    )
    timeout = ddp_kwargs.get("timeout")
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(
            f"timeout (the process group's) must be a datetime.timedelta, e.g. timeout=timedelta(seconds=30), "
            f"got {timeout!r}."
        )
    backend = ddp_kwargs.get("process_group_backend")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"process_group_backend must be a name such as 'gloo' or 'nccl', got {backend!r}.")
    if backend is not None and backend.lower() == "nccl" and not resources.use_gpu:
        raise ValueError(
            f"process_group_backend='nccl' needs GPUs, but the workers reserve none ({resources.describe()}). "
            "Use process_group_backend='gloo' (or leave it out), or reserve GPUs with use_gpu=True or "
            "resources_per_worker={'GPU': 1}."
        )
    return ddp_kwargs


class RayStrategy(RayWorkersMixin):
    """PyTorch DDP across Ray actors, one actor per worker: Lightning's ``DDPStrategy``.

    The same class serves ``lightning.pytorch`` and ``pytorch_lightning`` Trainers
    (:mod:`ray_lightning.namespaces`).

    Args:
        num_workers: number of training processes (Ray actors); ``(min, max)``: elastic, as many as the cluster
            holds, fewer after a lost node, more again at an epoch's end (``RAY_LIGHTNING_NUM_WORKERS`` when left
            out: ``4`` or ``2,4``).
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
        scale_up_timeout_s: on a cluster whose autoscaler can add nodes the workers need, how long to
            wait for them (the driver logs what is pending meanwhile). Default 900 s, or
            ``RAY_LIGHTNING_SCALE_UP_TIMEOUT_S``.
        max_failures: how many times one ``fit`` (or ``validate``/``test``/``predict``) may restart its
            workers after a worker process dies, its node is lost or preempted, or a collective breaks
            because of it; the new workers resume from the newest recovery checkpoint. Exceptions raised
            by your code are not retried. Default 0 (a failure ends the call), or
            ``RAY_LIGHTNING_MAX_FAILURES``.
        recovery_checkpoint_every_n_steps: with ``max_failures > 0``, the ranks write a recovery
            checkpoint (into ``storage_path``, else into a folder on the driver's machine) at every epoch
            boundary, and also every this many optimizer steps when set.
            Default None (epoch boundaries only), or ``RAY_LIGHTNING_RECOVERY_CHECKPOINT_EVERY_N_STEPS``.
        batch_policy: with ``num_workers=(min, max)``, what a resize keeps: ``"keep_global_batch"`` (default: the
            global batch of ``max`` workers), ``"scale_lr"`` (learning rates x ``world_size / max``) or ``"leave"``.
        grow_check_interval_s: with ``num_workers=(min, max)``, the least time between two checks (at recovery
            checkpoints: epoch ends, and every ``recovery_checkpoint_every_n_steps``) for room for more workers.
            Default 30 s.
        **ddp_kwargs: passed to Lightning's ``DDPStrategy`` and from there to
            ``DistributedDataParallel`` (``find_unused_parameters=True``, ``static_graph=True``, ...).

    Example::

        trainer = pl.Trainer(max_epochs=4, strategy=RayStrategy(num_workers=4, use_gpu=True))
        trainer.fit(model)  # the weights, metrics and best checkpoint are back here afterwards
        # on spot nodes: 2 to 8 workers, the global batch of 8 kept
        RayStrategy(num_workers=(2, 8), use_gpu=True, max_failures=5)
    """

    registry_name = "ray"
    lightning_base = "strategies.DDPStrategy"

    state_in_every_rank = True  # DDP: every rank holds the whole state (launch.memory)
    collective_checkpoints = True  # every rank writes a part of each recovery checkpoint (home.spread)

    @worker_arguments(
        passes_on=("strategies.DDPStrategy", "torch.nn.parallel.DistributedDataParallel"), decided=_DECIDED
    )
    def __init__(self, **ddp_kwargs: Any) -> None:
        ddp_kwargs = _check_ddp_kwargs(type(self), ddp_kwargs, self.resources)
        # The arguments set here by name are the ones RayStrategy decides; naming them also keeps
        # LightningCLI/jsonargparse, which follows **ddp_kwargs into DDPStrategy, from offering them.
        super().__init__(
            accelerator=None,
            parallel_devices=None,
            cluster_environment=None,
            checkpoint_io=None,
            start_method="popen",
            **ddp_kwargs,
        )

    @override
    def setup_distributed(self) -> None:
        self.join_process_group()
        runtime.mark_progress("setup", "prepare_data, setup hooks, configure_model")

    @override
    def configure_ddp(self) -> None:
        # One worker has no gradients to reduce: DDP's wrapper would only cost (1.28x a single device's step on a
        # small MLP, measured on an H200), so the module trains as it is, as on one device.
        if self.world_size == 1:
            return
        super().configure_ddp()
        # The time each rank waits for the all-reduce (channel.timings), from the reducer's own sampled timings:
        # a comm hook in Python would see it too, at ~1.5 ms of CPU per step (measured, benchmarks/README.md).
        clock = runtime.step_clock()
        if clock is not None:
            clock.wait_probe = allreduce_wait_probe(self.model)


class RayAccelerator(accelerator.WorkerAccelerator):
    """Train on ``num_workers`` Ray actors with PyTorch DDP: the classic form of :class:`RayStrategy`.

    Args:
        num_workers: number of training processes (Ray actors).
        cpus_per_worker: CPUs reserved for each worker.
        use_gpu: reserve one GPU per worker and train on CUDA with NCCL.
        **strategy_kwargs: any other :class:`~ray_lightning.RayStrategy` argument
            (``resources_per_worker``, ``init_hook``, DDP keyword arguments, ...).

    Example::

        trainer = pl.Trainer(max_epochs=2,
                             accelerator=RayAccelerator(num_workers=4, cpus_per_worker=1, use_gpu=False))
        trainer.fit(model)
    """

    strategy_class = RayStrategy


accelerator.register(RayAccelerator, "DDP on Ray actors")
