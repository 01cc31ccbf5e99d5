"""``RayFSDP1Strategy``: Lightning's own ``FSDPStrategy`` (torch's FSDP1) on Ray GPU actors.

For users whose Lightning code already uses ``FSDPStrategy`` (its auto-wrap policies,
``use_orig_params``, ``device_mesh`` for hybrid sharding, ``state_dict_type``) and who want exactly
that on Ray. Lightning does the sharding, precision and checkpoints; this class changes where the
processes come from, how they meet (rank 0's TCPStore, NCCL) and what comes home, as for ``RayStrategy``.

Decisions:

* GPUs only: torch's FSDP1 refuses to run without an accelerator ("FSDP needs a non-CPU accelerator
  device"), so workers without a GPU are refused before anything starts. ``RayFSDPStrategy``
  (FSDP2) is the sharded strategy for CPUs and GPUs alike.
* Sharded checkpoints (``state_dict_type="sharded"``): each rank writes its shard where it runs, a
  staging directory off the driver's machine that comes home, so ``best_model_path`` is a whole
  directory on the driver's machine. Restarts (``max_failures``) and Tune's checkpoints use a full
  checkpoint gathered on rank 0 (Lightning's ``state_dict_type="full"`` for the moment).
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from ray_lightning import runtime
from ray_lightning.config.arguments import check_keywords, refuse_decided
from ray_lightning.config.resources import WorkerResources
from ray_lightning.runtime import WorkerContext
from ray_lightning.strategies import accelerator
from ray_lightning.strategies.arguments import worker_arguments
from ray_lightning.strategies.ddp import RayAccelerator
from ray_lightning.strategies.sharded import FullCheckpointsMixin, check_sharding_arguments
from ray_lightning.strategies.workers import RayWorkersMixin

_DECIDED = {
    "accelerator": "from the GPUs the workers reserve",
    "parallel_devices": "from the GPUs the workers reserve",
    "cluster_environment": "from where Ray placed the workers",
    "checkpoint_io": "from Trainer(plugins=[...])",
    "precision_plugin": "from Trainer(precision=...)",
    "module": "Lightning wraps the LightningModule",
    "device_id": "each worker's GPU",
    "process_group": "process groups exist only in the workers; use device_mesh=(nodes, GPUs per node)",
}


class RayFSDP1Strategy(RayWorkersMixin, FullCheckpointsMixin):
    """Lightning's ``FSDPStrategy`` (torch's FSDP1) across Ray GPU actors, one actor per GPU.

    Args:
        num_workers, num_cpus_per_worker, resources_per_worker, init_hook: as for ``RayStrategy``.
        use_gpu: must hold (default ``True``): FSDP1 needs a GPU per worker.
        full_weights_home: bring the trained weights into the driver's module after ``fit`` (gathered on
            rank 0). None (default): when the model takes at most half the driver's free memory.
        placement_timeout_s, worker_start_timeout_s, keep_workers_alive_s, progress_timeout_s: as for ``RayStrategy``.
        scale_up_timeout_s, max_failures, recovery_checkpoint_every_n_steps: as for ``RayStrategy``.
        **fsdp_kwargs: Lightning's ``FSDPStrategy`` arguments (``auto_wrap_policy``, ``sharding_strategy``,
            ``cpu_offload``, ``mixed_precision``, ``activation_checkpointing_policy``, ``state_dict_type``,
            ``device_mesh``, ``process_group_backend``, ``timeout``) and torch's ``FullyShardedDataParallel``'s.

    Example::

        trainer = pl.Trainer(strategy=RayFSDP1Strategy(num_workers=8, auto_wrap_policy={TransformerBlock}),
                             precision="bf16-mixed")
        trainer.fit(model)  # the full trained weights are in `model` afterwards
    """

    # Its engine writes checkpoints with local file I/O: storage_path must be a directory every node mounts.
    writes_to_urls = False

    registry_name = "fsdp1_ray"
    lightning_base = "strategies.FSDPStrategy"

    @worker_arguments(
        defaults={"use_gpu": True},
        passes_on=("strategies.FSDPStrategy", "torch.distributed.fsdp.FullyShardedDataParallel"),
        decided=_DECIDED,
    )
    def __init__(self, *, full_weights_home: bool | None = None, **fsdp_kwargs: Any) -> None:
        fsdp_kwargs = self._check_fsdp1_arguments(self.resources, full_weights_home, fsdp_kwargs)
        self.full_weights_home = full_weights_home
        super().__init__(accelerator=None, parallel_devices=None, cluster_environment=None, **fsdp_kwargs)

    @classmethod
    def _check_fsdp1_arguments(
        cls, resources: WorkerResources, full_weights_home: Any, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """Refuse here what would fail in every worker; returns the arguments to pass on."""
        if not resources.use_gpu or resources.gpus < 1:
            raise ValueError(
                f"RayFSDP1Strategy (torch's FSDP1) needs one whole GPU per worker, but the workers reserve "
                f"{resources.describe()}: FSDP1 refuses to run without one. Use RayFSDPStrategy (FSDP2), which "
                "shards on CPUs and GPUs alike."
            )
        kwargs = refuse_decided("RayFSDP1Strategy", kwargs, _DECIDED)
        check_keywords("RayFSDP1Strategy", kwargs, cls.accepted_keywords(), "its arguments, FSDPStrategy's and FSDP's")
        check_sharding_arguments(True, kwargs.get("process_group_backend"), kwargs.get("timeout"), full_weights_home)
        if kwargs.get("state_dict_type", "full") not in ("full", "sharded"):
            raise ValueError(f"state_dict_type must be 'full' or 'sharded', got {kwargs['state_dict_type']!r}.")
        return kwargs

    @override
    def check_trainer(self, trainer: Any) -> None:
        self.decide_full_weights(trainer)

    @override
    def attach_worker(self, context: WorkerContext, rendezvous_store: Any) -> None:
        super().attach_worker(context, rendezvous_store)
        plugin = self.precision_plugin
        if plugin.precision == "16-mixed":
            # Its gradient scaler was made on the driver, where no GPU may be (and is then disabled for good).
            self.precision_plugin = type(plugin)(plugin.precision)

    @override
    def setup_environment(self) -> None:
        # The device (Strategy's), then our process group instead of Lightning's MASTER_ADDR/PORT one.
        super(self.namespace.pl("strategies.FSDPStrategy"), self).setup_environment()
        self.join_process_group()
        mesh = self.kwargs.get("device_mesh")
        if isinstance(mesh, tuple):  # (nodes, GPUs per node) for HYBRID_SHARD, as Lightning's
            from torch.distributed.device_mesh import init_device_mesh

            self.kwargs["device_mesh"] = init_device_mesh("cuda", mesh)
        runtime.mark_progress("setup", "prepare_data, setup hooks, configure_model")


class RayFSDP1Accelerator(RayAccelerator):
    """Lightning's FSDP1 on Ray GPU actors: the classic form of :class:`RayFSDP1Strategy`.

    Takes ``RayAccelerator``'s arguments (``use_gpu`` must hold) and any other ``RayFSDP1Strategy`` argument.

    Example::

        trainer = pl.Trainer(accelerator=RayFSDP1Accelerator(num_workers=8, use_gpu=True))
    """

    strategy_class = RayFSDP1Strategy


accelerator.register(RayFSDP1Accelerator, "Lightning's FSDPStrategy (torch's FSDP1) on Ray GPU actors")
