"""The Fabric strategies behind ``Fabric(strategy=RayStrategy(...))``: Fabric's own, on Ray actors.

A Fabric user names the strategy a Trainer user knows (``RayStrategy``, ``RayFSDPStrategy``, or a registered
name: ``"ray"``, ``"fsdp_ray"``); Fabric's connector (wrapped in :mod:`ray_lightning._lightning.fabric`)
hands it to :func:`for_fabric`, which returns its Fabric form, built on the same record of workers:

* :class:`RayFabricDDPStrategy`: Fabric's ``DDPStrategy`` (``RayStrategy``),
* :class:`RayFabricFSDPStrategy`: Fabric's ``ModelParallelStrategy`` whose ``parallelize_fn`` shards as
  ``RayFSDPStrategy`` does (FSDP2, its wrap policy and options), over a mesh of every rank,
* :class:`RayFabricModelParallelStrategy`: Fabric's ``ModelParallelStrategy`` with the user's ``parallelize_fn``
  (``RayModelParallelStrategy(parallelize_fn=...)``),
* :class:`RayFabricDeepSpeedStrategy`: Fabric's ``DeepSpeedStrategy`` (``RayDeepSpeedStrategy``).

:class:`~ray_lightning.fabric.workers.RayFabricWorkers` is what they share: the Trainer strategies' workers and
process group (:class:`~ray_lightning.strategies.workers.RayWorkersMixin`), Fabric's private hooks
(:class:`~ray_lightning._lightning.fabric.FabricStrategyHooks`), the launcher that runs ``fabric.launch(fn)``
on the actors (:class:`~ray_lightning.fabric.launcher.RayFabricLauncher`), progress for the hang watchdog
from collectives and ``backward``, and the paths ``fabric.save``/``fabric.load`` read and write in a worker:
relative to the driver's working directory, and under a staging directory on a node that is not the
driver's (the files come home when ``launch`` returns).

Decision: the Fabric forms are not public constructors of their own. One name per strategy for both APIs is
what users asked for (the issue), and the Trainer strategies already check every argument on the driver.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from typing_extensions import override

from ray_lightning import _lightning, namespaces
from ray_lightning.fabric.workers import RayFabricWorkers
from ray_lightning.namespaces import Namespace
from ray_lightning.strategies.ddp import RayStrategy
from ray_lightning.strategies.deepspeed import RayDeepSpeedStrategy, adopt_process_group, deepspeed_device
from ray_lightning.strategies.fsdp import RayFSDPStrategy, mesh_layout
from ray_lightning.strategies.model_parallel import RayModelParallelStrategy, model_parallel_mesh
from ray_lightning.strategies.workers import RayWorkersMixin


class RayFabricDDPStrategy(RayFabricWorkers):
    """Fabric's ``DDPStrategy`` on Ray actors: what ``Fabric(strategy=RayStrategy(...))`` uses."""

    lightning_base = "strategies.DDPStrategy"
    trainer_strategy = RayStrategy

    @override
    def fabric_init(self, source: Any) -> None:
        self.fabric_base().__init__(
            self,
            process_group_backend=source.requested_process_group_backend,
            timeout=source.ddp_timeout,
            start_method="popen",
            **_lightning.fabric.ddp_kwargs(source),
        )


class RayFabricModelParallelBase(RayFabricWorkers):
    """Fabric's ``ModelParallelStrategy`` on Ray actors, meeting in our process group, over a mesh of our layout."""

    writes_to_urls = False  # Fabric's own saving: torch.save on rank 0, or torch.distributed.checkpoint's files

    def model_parallel_init(self, parallelize_fn: Any, mesh_shape: tuple[int, int], saves_sharded: bool) -> None:
        """Fabric's ``ModelParallelStrategy.__init__``, ``mesh_shape`` its (data parallel, tensor parallel) sizes."""
        self.fabric_base().__init__(
            self,
            parallelize_fn=parallelize_fn,
            data_parallel_size=mesh_shape[0],
            tensor_parallel_size=mesh_shape[1],
            save_distributed_checkpoint=saves_sharded,
            process_group_backend=self.source.requested_process_group_backend,
            timeout=self.source.ddp_timeout,
        )

    def device_mesh_now(self) -> Any:
        """In a worker, after meeting: the device mesh ``parallelize_fn`` shards over."""
        raise NotImplementedError

    @override
    def setup_environment(self) -> None:
        # Fabric's would meet through MASTER_ADDR/PORT and size the mesh by the driver's devices.
        self.accelerator.setup_device(self.root_device)
        self.join_process_group()
        _lightning.sharded.set_strategy_mesh(self, self.device_mesh_now())


class RayFabricFSDPStrategy(RayFabricModelParallelBase):
    """Fabric's ``ModelParallelStrategy``, sharding as ``RayFSDPStrategy`` does: ``Fabric(strategy=RayFSDPStrategy())``.

    ``fabric.setup(model)`` shards the model (FSDP2, ``auto_wrap_policy`` and the other options of the
    ``RayFSDPStrategy``); ``state_dict_type="sharded"`` makes ``fabric.save`` write a
    ``torch.distributed.checkpoint`` directory, which ``fabric.load`` reads on any number of workers.
    """

    lightning_base = "strategies.ModelParallelStrategy"
    trainer_strategy = RayFSDPStrategy

    @override
    def fabric_init(self, source: Any) -> None:
        parallelize = functools.partial(_shard, source)
        self.model_parallel_init(parallelize, (self.num_workers, 1), source.state_dict_type == "sharded")

    @override
    def device_mesh_now(self) -> Any:
        # Fabric's mesh is (data parallel, tensor parallel); FSDP2 shards over a mesh of its own layout.
        from torch.distributed.device_mesh import init_device_mesh

        source = self.source
        shape, names = mesh_layout(source.sharding_strategy, self.world_size, self.num_processes, self.num_nodes)
        return init_device_mesh(self.root_device.type, shape, mesh_dim_names=names)


def _shard(source: Any, module: Any, mesh: Any) -> Any:
    return source.shard(module, mesh)


class RayFabricModelParallelStrategy(RayFabricModelParallelBase):
    """Fabric's ``ModelParallelStrategy``: ``Fabric(strategy=RayModelParallelStrategy(..., parallelize_fn=fn))``.

    ``fabric.setup(model)`` calls ``fn(model, device_mesh)`` on the ``(data_parallel, tensor_parallel)`` mesh
    of the strategy's sizes; the data splits over the data-parallel dimension.
    """

    lightning_base = "strategies.ModelParallelStrategy"
    trainer_strategy = RayModelParallelStrategy

    @override
    def fabric_init(self, source: Any) -> None:
        if source.parallelize_fn is None:
            raise TypeError(
                "Fabric(strategy=RayModelParallelStrategy(...)) needs parallelize_fn=fn, the function "
                "(module, device_mesh) -> module that fabric.setup shards the model with (as for Fabric's "
                "ModelParallelStrategy). To shard without writing one, use RayFSDPStrategy."
            )
        saves_sharded = _lightning.sharded.saves_sharded_checkpoints(source)
        self.model_parallel_init(source.parallelize_fn, source.mesh_shape, saves_sharded)

    @override
    def device_mesh_now(self) -> Any:
        return model_parallel_mesh(self, self.source.mesh_shape)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        mesh = self.device_mesh["data_parallel"]
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}


class RayFabricDeepSpeedStrategy(RayFabricWorkers):
    """Fabric's ``DeepSpeedStrategy`` (ZeRO) on Ray actors: ``Fabric(strategy=RayDeepSpeedStrategy(stage=3))``.

    As for the Trainer: the process group is ours and DeepSpeed adopts it, CPU workers train with DeepSpeed's
    CPU accelerator, ``fabric.save`` writes DeepSpeed's checkpoint directory (every rank its part), and every
    launch starts new worker processes.
    """

    lightning_base = "strategies.DeepSpeedStrategy"
    trainer_strategy = RayDeepSpeedStrategy
    writes_to_urls = False

    @override
    def fabric_init(self, source: Any) -> None:
        base = self.fabric_base()
        accepted = set(inspect.signature(base.__init__).parameters) - {"self", *_DEEPSPEED_DECIDED}
        base.__init__(self, **{k: v for k, v in source.init_arguments.items() if k in accepted})

    @property
    @override
    def root_device(self) -> Any:
        return deepspeed_device(super().root_device, self._worker is not None, self.local_rank)

    @override
    def setup_environment(self) -> None:
        # Fabric's refuses every accelerator but its CUDAAccelerator: DDP's sets up the device, then meets.
        super(self.fabric_base(), self).setup_environment()

    @override
    def join_process_group(self) -> None:
        super().join_process_group()
        adopt_process_group(self)
        _lightning.fabric.format_deepspeed_config(self)


# Arguments of Fabric's DeepSpeedStrategy the Fabric form decides (the rest come from the RayDeepSpeedStrategy).
_DEEPSPEED_DECIDED = ("accelerator", "parallel_devices", "cluster_environment", "precision")

# The Trainer strategy -> its Fabric form. Horovod has no Fabric form (Fabric has no Horovod strategy).
FABRIC_FORMS: dict[type, type] = {
    RayStrategy: RayFabricDDPStrategy,
    RayFSDPStrategy: RayFabricFSDPStrategy,
    RayModelParallelStrategy: RayFabricModelParallelStrategy,
    RayDeepSpeedStrategy: RayFabricDeepSpeedStrategy,
}


def for_fabric(strategy: Any, accelerator: Any, ns: Namespace) -> tuple[Any, Any]:
    """What Fabric's connector gets instead of ``strategy`` (and ``accelerator``): see the module docstring."""
    if isinstance(accelerator, _lightning.BringsItsStrategy):
        # The classic form, Fabric(accelerator=RayAccelerator(...)): its strategy, as for the Trainer.
        if strategy not in ("auto", None):
            raise ValueError(
                f"Fabric(accelerator={type(accelerator).__name__}(...)) brings its own strategy: drop strategy="
                f"{strategy!r}, or pass strategy={accelerator.strategy_class.__name__}(...) alone."
            )
        strategy, accelerator = accelerator.make_strategy(), "auto"
    if isinstance(strategy, str):
        strategy = _registered(strategy, ns) or strategy
    if isinstance(strategy, RayFabricWorkers):
        strategy = strategy if type(strategy).namespace == ns else _form(strategy.source, ns)
    elif isinstance(strategy, RayWorkersMixin):
        strategy = _form(strategy, ns)
    else:
        return strategy, accelerator
    # The workers' reserved GPUs decide the device (a warning where accelerator= disagrees), not the driver's.
    strategy.accelerator = strategy.prepare_for_trainer(accelerator)
    return strategy, "auto"


def _form(source: Any, ns: Namespace) -> Any:
    public = type(source).public if type(source).namespace is not None else type(source)
    form = next((f for t, f in FABRIC_FORMS.items() if issubclass(public, t)), None)
    if form is None:
        names = ", ".join(t.__name__ for t in FABRIC_FORMS)
        raise TypeError(
            f"Fabric(strategy={public.__name__}(...)): Fabric on Ray runs {names}; "
            f"{public.__name__} has no Fabric form."
        )
    return namespaces.member(form, ns)(namespaces.rebuild_for(source, ns))


def _registered(name: str, ns: Namespace) -> Any:
    """The Fabric strategy registered as ``name``, built now, if it is ours (built before Fabric chooses devices)."""
    registry = ns.fabric("strategies.STRATEGY_REGISTRY")
    name = name.lower()
    cls = registry[name]["strategy"] if name in registry else None
    return registry.get(name) if isinstance(cls, type) and issubclass(cls, RayFabricWorkers) else None


def register() -> None:
    """Fabric's registry names, as the Trainer's: ``Fabric(strategy="ray")``, ``Fabric(strategy="fsdp_ray")``."""
    for ns in namespaces.installed():
        registry = ns.fabric("strategies.STRATEGY_REGISTRY")
        for trainer_strategy, form in FABRIC_FORMS.items():
            if trainer_strategy.registry_name not in registry:
                registry.register(
                    trainer_strategy.registry_name,
                    namespaces.member(form, ns),
                    description=f"{trainer_strategy.__name__} for Fabric (ray_lightning)",
                )
