"""``RayModelParallelStrategy``: Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor parallelism) on Ray actors.

The module's ``configure_model`` applies ``fully_shard`` and/or ``parallelize_module`` on
``self.device_mesh``, a 2-D mesh ``(data_parallel, tensor_parallel)`` built from where Ray placed
the workers: ranks on one node are consecutive, so a tensor-parallel group (consecutive ranks) stays
inside a node whenever the node's workers divide into such groups. Lightning does the rest
(``configure_model`` under its init contexts, optimizers, precision); the workers, resources,
errors, restarts, Tune callbacks, staged files and results home are those of ``RayStrategy``.
Checkpoints and the weights home are collective (:mod:`.sharded`).
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from ray_lightning import _lightning, runtime
from ray_lightning.strategies import accelerator
from ray_lightning.strategies.arguments import worker_arguments
from ray_lightning.strategies.ddp import RayAccelerator
from ray_lightning.strategies.sharded import ShardedWorkersMixin, check_sharding_arguments, require_sharding_torch
from ray_lightning.strategies.workers import RayWorkersMixin

if TYPE_CHECKING:
    import pytorch_lightning as pl

AUTO = "auto"


def mesh_sizes(num_workers: int, data_parallel_size: Any, tensor_parallel_size: Any) -> tuple[int, int]:
    """``(data_parallel_size, tensor_parallel_size)`` whose product is ``num_workers``; "auto" fills in.

    Decision: both "auto" is data parallel only (tensor_parallel_size=1). Lightning's "auto" makes a
    tensor-parallel group of each node's devices, but where Ray puts the workers is known only once
    they are placed, and the sizes must be checked before anything starts.
    """
    given = {}
    for name, value in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
        if value == AUTO:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise TypeError(f'{name} must be an int >= 1 or "auto", got {value!r}.')
        given[name] = int(value)
    dp, tp = given.get("data_parallel_size"), given.get("tensor_parallel_size")
    if dp is None and tp is None:
        return num_workers, 1
    if dp is not None and tp is not None and dp * tp == num_workers:
        return dp, tp
    known, name = (dp, "data_parallel_size") if tp is None else (tp, "tensor_parallel_size")
    if dp is not None and tp is not None:
        raise ValueError(
            f"data_parallel_size={dp} x tensor_parallel_size={tp} = {dp * tp}, but num_workers={num_workers}: "
            "the two sizes must multiply to the number of workers."
        )
    if num_workers % known:
        raise ValueError(
            f"{name}={known} does not divide num_workers={num_workers}; give a size that divides it, or both sizes."
        )
    other = num_workers // known
    return (known, other) if name == "data_parallel_size" else (other, known)


class RayModelParallelStrategy(RayWorkersMixin, ShardedWorkersMixin):
    """Lightning's ``ModelParallelStrategy`` across Ray actors: your ``configure_model`` shards the model.

    Args:
        num_workers: training processes (Ray actors), ``data_parallel_size x tensor_parallel_size``.
        data_parallel_size: size of the mesh's ``"data_parallel"`` dimension (FSDP2's sharding, the data split).
        tensor_parallel_size: size of its ``"tensor_parallel"`` dimension: groups of consecutive ranks, kept
            inside a node where the node's workers allow. Both "auto" (default): data parallel only.
        num_cpus_per_worker, use_gpu, resources_per_worker, init_hook: as for ``RayStrategy``.
        save_distributed_checkpoint: ``True`` (default): each rank saves its shard, a checkpoint is a
            directory; ``False``: rank 0 gathers and saves one file (loadable with ``load_from_checkpoint``).
        process_group_backend, timeout: as for Lightning's ``ModelParallelStrategy``.
        full_weights_home: bring the trained weights into the driver's module after ``fit`` (gathered on
            rank 0). None (default): when the model takes at most half the driver's free memory.
        parallelize_fn: for Lightning Fabric (``Fabric(strategy=RayModelParallelStrategy(...))``): the function
            ``(module, device_mesh) -> module`` that ``fabric.setup`` shards the model with, as for Fabric's
            ``ModelParallelStrategy``. A Trainer shards in the module's ``configure_model`` instead.
        placement_timeout_s, worker_start_timeout_s, keep_workers_alive_s, progress_timeout_s: as for ``RayStrategy``.
        scale_up_timeout_s, max_failures, recovery_checkpoint_every_n_steps: as for ``RayStrategy``.

    Example::

        class Model(pl.LightningModule):
            def configure_model(self):
                for block in self.blocks:
                    fully_shard(block, mesh=self.device_mesh["data_parallel"])
                fully_shard(self, mesh=self.device_mesh["data_parallel"])

        trainer = pl.Trainer(strategy=RayModelParallelStrategy(num_workers=4, tensor_parallel_size=2))
    """

    registry_name = "model_parallel_ray"
    lightning_base = "strategies.ModelParallelStrategy"

    @worker_arguments()
    def __init__(
        self,
        data_parallel_size: int | str = AUTO,
        tensor_parallel_size: int | str = AUTO,
        *,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
        full_weights_home: bool | None = None,
        parallelize_fn: Callable[[Any, Any], Any] | None = None,
    ) -> None:
        require_sharding_torch("RayModelParallelStrategy", self.resources, process_group_backend)
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise TypeError(f"parallelize_fn takes a function (module, device_mesh) -> module, got {parallelize_fn!r}.")
        self.parallelize_fn = parallelize_fn
        dp, tp = mesh_sizes(self.num_workers, data_parallel_size, tensor_parallel_size)
        refuse_sizes_the_mesh_cannot_keep(self.workers.elastic, data_parallel_size, tp)
        check_sharding_arguments(self.use_gpu, process_group_backend, timeout, full_weights_home)
        self.full_weights_home = full_weights_home
        super().__init__(
            data_parallel_size=dp,
            tensor_parallel_size=tp,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.mesh_shape = (dp, tp)

    @override
    def check_trainer(self, trainer: pl.Trainer) -> None:
        if self.parallelize_fn is not None:
            raise TypeError(
                "RayModelParallelStrategy(parallelize_fn=...) is for Lightning Fabric; a Trainer shards the model in "
                "the LightningModule's configure_model() on self.device_mesh. Drop parallelize_fn for the Trainer."
            )
        module = trainer.lightning_module
        if module is not None and not self.namespace.pl("utilities.model_helpers.is_overridden")(
            "configure_model", module
        ):
            raise TypeError(
                f"{type(self).__name__} needs the LightningModule to override configure_model() and shard the model "
                "there on self.device_mesh (fully_shard on self.device_mesh['data_parallel'], parallelize_module on "
                "self.device_mesh['tensor_parallel']). To shard a model without writing that, use RayFSDPStrategy."
            )
        self.decide_full_weights(trainer)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The data splits over the data-parallel dimension: a tensor-parallel group sees the same batches.
        mesh = self.device_mesh["data_parallel"]
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    @override
    def setup_environment(self) -> None:
        # Strategy.setup_environment (the accelerator's device), then our process group and mesh:
        # Lightning's would meet through MASTER_ADDR/PORT and size the mesh by the driver's devices.
        super(self.namespace.pl("strategies.ModelParallelStrategy"), self).setup_environment()
        self.join_process_group()
        self.build_device_mesh()
        runtime.mark_progress("setup", "prepare_data, setup hooks, configure_model")

    def build_device_mesh(self) -> None:
        """The ``(data_parallel, tensor_parallel)`` mesh over the process group, for ``self.device_mesh``."""
        tp = self.mesh_shape[1]
        # An elastic fit's data-parallel size follows the workers it has now (the tensor-parallel size is kept).
        shape = (self.world_size // tp, tp) if self.workers.elastic is not None else self.mesh_shape
        _lightning.sharded.set_device_mesh(self, model_parallel_mesh(self, shape))


def refuse_sizes_the_mesh_cannot_keep(elastic: Any, data_parallel_size: Any, tensor_parallel_size: int) -> None:
    """An elastic ``num_workers=(min, max)`` keeps ``tensor_parallel_size`` and varies the data-parallel size: every
    size in the range must be a multiple of it, and ``data_parallel_size`` must be left to follow."""
    if elastic is None:
        return
    sizes = range(elastic.min_workers, elastic.max_workers + 1)
    if data_parallel_size != AUTO:
        raise ValueError(
            f"RayModelParallelStrategy(num_workers=({elastic.min_workers}, {elastic.max_workers})) varies the data-"
            f"parallel size with the workers: leave data_parallel_size out (got {data_parallel_size!r})."
        )
    bad = [n for n in sizes if n % tensor_parallel_size]
    if bad:
        raise ValueError(
            f"RayModelParallelStrategy(num_workers=({elastic.min_workers}, {elastic.max_workers})) keeps "
            f"tensor_parallel_size={tensor_parallel_size}, which does not divide {', '.join(map(str, bad))} workers; "
            "give a range of multiples of it."
        )


def model_parallel_mesh(strategy: Any, mesh_shape: tuple[int, int]) -> Any:
    """The ``(data_parallel, tensor_parallel)`` device mesh of ``mesh_shape`` over ``strategy``'s process group."""
    from torch.distributed.device_mesh import init_device_mesh

    dp, tp = mesh_shape
    _warn_if_group_spans_nodes(strategy, tp)
    return init_device_mesh(strategy.root_device.type, (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))


def _warn_if_group_spans_nodes(strategy: Any, tensor_parallel_size: int) -> None:
    """Tensor parallelism talks at every layer: a group split over nodes works, slowly. Say so."""
    if tensor_parallel_size == 1 or strategy.num_nodes == 1:
        return
    rank, local = strategy.global_rank, strategy.local_rank
    node_first, node_size = rank - local, strategy.num_processes
    group_first = rank - rank % tensor_parallel_size
    if group_first < node_first or group_first + tensor_parallel_size > node_first + node_size:
        warnings.warn(
            f"ray_lightning: rank {rank}'s tensor-parallel group (ranks {group_first}-"
            f"{group_first + tensor_parallel_size - 1}) spans nodes: its collectives cross the network at every "
            f"layer. Give each node a multiple of tensor_parallel_size={tensor_parallel_size} workers.",
            stacklevel=2,
        )


class RayModelParallelAccelerator(RayAccelerator):
    """ModelParallelStrategy on Ray actors: the classic form of :class:`RayModelParallelStrategy`.

    Takes ``RayAccelerator``'s arguments and any other ``RayModelParallelStrategy`` argument.

    Example::

        trainer = pl.Trainer(accelerator=RayModelParallelAccelerator(num_workers=4, tensor_parallel_size=2))
    """

    strategy_class = RayModelParallelStrategy


accelerator.register(RayModelParallelAccelerator, "ModelParallelStrategy (FSDP2, tensor parallel) on Ray actors")
