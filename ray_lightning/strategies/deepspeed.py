"""``RayDeepSpeedStrategy``: Lightning's ``DeepSpeedStrategy`` (ZeRO stages 1-3) on Ray actors.

Lightning's strategy does the work (the DeepSpeed config, ``deepspeed.initialize``, precision,
ZeRO checkpoints); this class changes where the processes come from, how they meet and what
comes home, as for ``RayStrategy``:

* The process group is ours (rank 0's TCPStore, gloo or NCCL); ``deepspeed.init_distributed``
  adopts it instead of meeting through ``MASTER_ADDR``.
* The device is the one Ray reserved. Lightning's strategy refuses every accelerator but its own
  ``CUDAAccelerator``; the Ray accelerator follows the worker's device instead, and DeepSpeed
  trains on CPUs too (its CPU accelerator, gloo). On a CPU worker the root device carries the local
  rank as its index (``cpu:<local rank>``, which tensors ignore), the device rank DeepSpeed is given.
* Checkpoints are DeepSpeed's: a directory every rank writes its partitions into. Ranks off the
  driver's machine write into a staging directory that comes home, so ``best_model_path`` is a
  whole directory on the driver's machine; ``fit``/``test(ckpt_path=...)`` send it to the workers.
  Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` turns it into one file.
* After ``fit`` the driver's module holds the full trained weights (gathered under ZeRO stage 3).

Decisions:

* No restarts (``max_failures`` must be 0): a ZeRO optimizer's state is partitioned over the ranks,
  so the one-file recovery checkpoint rank 0 writes cannot hold it, and resuming without
  it would change the training. Tune's trial restarts from ``ModelCheckpoint`` directories work.
* Every call starts new worker processes (no ``keep_workers_alive_s``): DeepSpeed keeps its
  process groups in module globals, which a worker's next call would find pointing at a process
  group that no longer exists.
* ``TuneReportCheckpointCallback`` is refused before launch (it sends Tune one file, DeepSpeed
  writes a directory on every rank); use ``TuneReportCallback`` with a ``ModelCheckpoint``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from ray_lightning import runtime
from ray_lightning.config.arguments import check_keywords, refuse_decided
from ray_lightning.config.resources import WorkerResources
from ray_lightning.strategies import accelerator
from ray_lightning.strategies.arguments import worker_arguments
from ray_lightning.strategies.ddp import RayAccelerator
from ray_lightning.strategies.sharded import RankPartsMixin, check_sharding_arguments
from ray_lightning.strategies.workers import RayWorkersMixin

if TYPE_CHECKING:
    import pytorch_lightning as pl

# Arguments of Lightning's DeepSpeedStrategy this strategy decides, and why.
_DECIDED = {
    "accelerator": "from the GPUs the workers reserve",
    "parallel_devices": "from the GPUs the workers reserve",
    "cluster_environment": "from where Ray placed the workers",
    "precision_plugin": "from Trainer(precision=...)",
}
INSTALL_HINT = (
    "RayDeepSpeedStrategy needs DeepSpeed in the driver and the workers: pip install deepspeed "
    "(where torch is the CPU build or must not be replaced: DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)."
)


# DeepSpeed's private name for the step after loading a ZeRO checkpoint (see load_checkpoint).
_RESTORE_FROM_BIT16 = "_restore_from_bit16_weights"


def deepspeed_device(device: torch.device, in_worker: bool, local_rank: int) -> torch.device:
    """The root device of a DeepSpeed rank: on a CPU worker ``cpu:<local rank>``, as DeepSpeed takes the device's
    index as the worker's device rank (tensors ignore a CPU index)."""
    return torch.device("cpu", local_rank) if device.type == "cpu" and in_worker else device


def adopt_process_group(strategy: Any) -> None:
    """DeepSpeed adopts the process group ``strategy`` joined (it would otherwise meet at MASTER_ADDR itself)."""
    import deepspeed

    deepspeed.init_distributed(strategy.worker_process_group_backend(), timeout=strategy.ddp_timeout)


def check_deepspeed_installed() -> None:
    """Refuse, before anything starts, a DeepSpeed strategy where DeepSpeed is missing."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ImportError(INSTALL_HINT)


class RayDeepSpeedStrategy(RayWorkersMixin, RankPartsMixin):
    """DeepSpeed ZeRO across Ray actors: Lightning's ``DeepSpeedStrategy``, one actor per worker.

    Args:
        num_workers, num_cpus_per_worker, use_gpu, resources_per_worker, init_hook: as for ``RayStrategy``.
        stage: the ZeRO stage: 1 (optimizer state partitioned), 2 (and gradients, the default),
            3 (and parameters).
        full_weights_home: bring the trained weights into the driver's module after ``fit`` (gathered
            on every rank under stage 3). None (default): when the model takes at most half the driver's
            free memory.
        placement_timeout_s, worker_start_timeout_s, progress_timeout_s, scale_up_timeout_s: as for
            ``RayStrategy``. There is no ``keep_workers_alive_s``: every call starts new workers (see below).
        max_failures: must be 0 (see the module's decisions); given for the workers' common signature.
        **deepspeed_kwargs: any argument of Lightning's ``DeepSpeedStrategy`` (``config``,
            ``offload_optimizer``, ``offload_parameters``, ``logging_batch_size_per_gpu``,
            ``process_group_backend``, ``timeout``, ``load_full_weights``, ...).

    Example::

        trainer = pl.Trainer(strategy=RayDeepSpeedStrategy(num_workers=8, use_gpu=True, stage=3),
                             precision="bf16-mixed")
        trainer.fit(model)  # the full trained weights are in `model` afterwards
    """

    # Its engine writes checkpoints with local file I/O: storage_path must be a directory every node mounts.
    writes_to_urls = False

    registry_name = "deepspeed_ray"
    lightning_base = "strategies.DeepSpeedStrategy"

    # Every call gets new worker processes: DeepSpeed keeps its process groups in module globals that
    # outlive a call's process group. Without restarts, no recovery checkpoints either.
    @worker_arguments(
        fixed={"keep_workers_alive_s": 0.0, "recovery_checkpoint_every_n_steps": None},
        passes_on=("strategies.DeepSpeedStrategy",),
        decided=_DECIDED,
    )
    def __init__(self, *, stage: int = 2, full_weights_home: bool | None = None, **deepspeed_kwargs: Any) -> None:
        check_deepspeed_installed()
        deepspeed_kwargs = self._check_deepspeed_arguments(stage, full_weights_home, deepspeed_kwargs, self.resources)
        if self.max_failures:
            raise ValueError(
                f"RayDeepSpeedStrategy cannot restart its workers (max_failures={self.max_failures}, from the argument "
                "or RAY_LIGHTNING_MAX_FAILURES): a ZeRO optimizer's state is split over the ranks, and a restart "
                "would resume without it. Use max_failures=0, or RayFSDPStrategy, which restarts."
            )
        elastic = self.workers.elastic
        if elastic is not None:
            raise ValueError(
                f"RayDeepSpeedStrategy cannot resize (num_workers=({elastic.min_workers}, {elastic.max_workers})): "
                "a resize restarts the workers from a checkpoint, and a ZeRO optimizer's state is split over the "
                "ranks. Give a fixed num_workers, or use RayFSDPStrategy, which resizes."
            )
        self.full_weights_home = full_weights_home
        super().__init__(
            accelerator=None, parallel_devices=None, cluster_environment=None, stage=stage, **deepspeed_kwargs
        )

    @classmethod
    def _check_deepspeed_arguments(
        cls, stage: Any, full_weights_home: Any, kwargs: dict[str, Any], resources: WorkerResources
    ) -> dict[str, Any]:
        """Refuse here what would fail in every worker; returns the arguments to pass on."""
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be a ZeRO stage 0, 1, 2 or 3, got {stage!r}.")
        kwargs = refuse_decided("RayDeepSpeedStrategy", kwargs, _DECIDED)
        check_keywords(
            "RayDeepSpeedStrategy", kwargs, cls.accepted_keywords(), "its arguments and Lightning's DeepSpeedStrategy's"
        )
        check_sharding_arguments(
            resources.use_gpu, kwargs.get("process_group_backend"), kwargs.get("timeout"), full_weights_home
        )
        return kwargs

    # Its checkpoint is a directory every rank writes its part of with local file I/O: a Tune trial's
    # (TuneReportCheckpointCallback) is written by the ranks into Tune's folder, which must be a directory every
    # node mounts; it is never gathered into one file.
    checkpoint_is_rank_directory = True

    @staticmethod
    def sees_checkpoint(location: str, world_size: int) -> bool:
        """Whether this process sees DeepSpeed's checkpoint directory at ``location`` whole: the tag its ``latest``
        names, with each of ``world_size`` ranks' ZeRO partition in it (or, without ZeRO, the model states)."""
        try:
            with open(os.path.join(location, "latest")) as f:
                names = set(os.listdir(os.path.join(location, f.read().strip())))
        except OSError:
            return False
        ranks = {r for r in range(world_size) if any(n.startswith(f"zero_pp_rank_{r}_") for n in names)}
        return len(ranks) == world_size or (not ranks and "mp_rank_00_model_states.pt" in names)

    @override
    def check_trainer(self, trainer: pl.Trainer) -> None:
        self.decide_full_weights(trainer)

    @property
    @override
    def root_device(self) -> torch.device:
        return deepspeed_device(super().root_device, self._worker is not None, self.local_rank)

    @override
    def setup_environment(self) -> None:
        # Lightning's refuses every accelerator but its CUDAAccelerator: skip to DDP's, which sets up
        # the worker's device and then calls setup_distributed.
        super(self.namespace.pl("strategies.DeepSpeedStrategy"), self).setup_environment()

    @override
    def setup_distributed(self) -> None:
        self.join_process_group()
        adopt_process_group(self)
        runtime.mark_progress("setup", "prepare_data, setup hooks, deepspeed.initialize")

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # Under ZeRO-3, test/validate/predict(ckpt_path=...) load into DeepSpeed's inference engine, whose
        # stand-in optimizer (DeepSpeedZeRoOffload) lacks the `_restore_from_bit16_weights` DeepSpeed then
        # calls (DeepSpeed#7272, open; Lightning's own strategy fails the same). It has no fp32 copy to
        # refresh: DeepSpeed already loaded the full fp32 weights into the module, so nothing is left to do.
        engine = self.deepspeed_engine
        optimizer = getattr(engine, "optimizer", None)
        if optimizer is not None and not hasattr(optimizer, _RESTORE_FROM_BIT16):
            setattr(optimizer, _RESTORE_FROM_BIT16, lambda: None)
        return super().load_checkpoint(checkpoint_path, *args, **kwargs)

    def weights_for_driver(self) -> dict[str, Any] | None:
        """In every rank (collective under ZeRO stage 3): the full state dict on rank 0, None elsewhere."""
        import deepspeed

        module = self.lightning_module
        if not self._full_weights_go_home(module.parameters()):  # ZeRO 3's partitioned ones by their ds_shape
            return None
        gathered = deepspeed.zero.GatheredParameters(
            list(module.parameters()), modifier_rank=None, enabled=self.zero_stage_3
        )
        with gathered:
            if self.global_rank != 0:
                return None
            return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


class RayDeepSpeedAccelerator(RayAccelerator):
    """DeepSpeed ZeRO on Ray actors: the classic form of :class:`RayDeepSpeedStrategy`.

    Takes ``RayAccelerator``'s arguments and any other ``RayDeepSpeedStrategy`` argument.

    Example::

        trainer = pl.Trainer(accelerator=RayDeepSpeedAccelerator(num_workers=4, use_gpu=True, stage=3))
    """

    strategy_class = RayDeepSpeedStrategy


accelerator.register(RayDeepSpeedAccelerator, "DeepSpeed ZeRO on Ray actors")
