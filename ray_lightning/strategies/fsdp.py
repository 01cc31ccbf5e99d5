"""``RayFSDPStrategy``: fully sharded data parallel (torch's FSDP2, ``fully_shard``) on Ray actors, no code to write.

The strategy shards the model itself, with the options Lightning's ``FSDPStrategy`` users know
(auto-wrap policy by layer class, sharding strategy, CPU offload, activation checkpointing, mixed
precision, ``state_dict_type``), so any LightningModule trains sharded unchanged.

Decision: FSDP2 (``torch.distributed.fsdp.fully_shard``), torch's current FSDP, not FSDP1
(``FullyShardedDataParallel``, what Lightning's ``FSDPStrategy`` wraps): FSDP1 in torch 2.13 refuses
to run without an accelerator ("FSDP needs a non-CPU accelerator device"), FSDP2 trains on CPU with
gloo and on GPUs alike. Lightning's FSDP1 strategy is ``RayFSDP1Strategy``, for GPUs.

How the options map onto FSDP2:

* ``auto_wrap_policy``: a set of layer classes (or a function ``module -> bool``): each matching
  module is its own FSDP unit (gathered for its forward and backward only). Then every child of the
  LightningModule that holds parameters not yet sharded is a unit, and so is the module itself when
  it has parameters of its own.
* ``sharding_strategy``: ``"FULL_SHARD"`` (default; parameters resharded after forward),
  ``"SHARD_GRAD_OP"`` (kept gathered between forward and backward), ``"NO_SHARD"`` (every rank holds
  everything: DDP through FSDP2, a 2-D mesh replicating over all ranks), ``"HYBRID_SHARD"`` (sharded
  within a node, replicated across nodes; every node must hold as many workers).
* ``cpu_offload``: ``True`` or a ``CPUOffloadPolicy``: parameters, gradients and optimizer state live
  in CPU memory (pinned only on GPUs: pinning needs one).
* ``mixed_precision``: a ``MixedPrecisionPolicy`` (e.g. ``param_dtype=torch.bfloat16``); or use
  ``Trainer(precision="bf16-mixed")``.
* ``activation_checkpointing_policy``: a set of layer classes (or a function): their activations are
  recomputed in the backward pass instead of kept.
* ``state_dict_type``: ``"full"`` (default, as Lightning's ``FSDPStrategy``): rank 0 gathers and writes
  one checkpoint file, which ``load_from_checkpoint`` reads; ``"sharded"``: each rank writes its shard,
  a checkpoint is a directory (``torch.distributed.checkpoint``) that ``fit``/``test(ckpt_path=...)``
  load on any number of workers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from typing_extensions import override

from ray_lightning import _lightning, _torch, namespaces, runtime
from ray_lightning.config.arguments import check_keywords
from ray_lightning.strategies import accelerator
from ray_lightning.strategies.arguments import worker_arguments
from ray_lightning.strategies.ddp import RayAccelerator
from ray_lightning.strategies.sharded import ShardedWorkersMixin, check_sharding_arguments, require_sharding_torch
from ray_lightning.strategies.workers import RayWorkersMixin

if TYPE_CHECKING:
    import pytorch_lightning as pl

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
STATE_DICT_TYPES = ("full", "sharded")


def module_selector(name: str, policy: Any) -> Callable[[nn.Module], bool] | None:
    """A function telling which modules ``policy`` (a set of classes, or a function) picks; None for none."""
    if policy is None:
        return None
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        policy = {policy}
    if isinstance(policy, Iterable) and not isinstance(policy, (str, bytes)):
        classes = tuple(policy)
        if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(f"{name} takes a set of nn.Module classes or a function module -> bool, got {policy!r}.")
        return lambda module: isinstance(module, classes)
    if callable(policy):
        return policy
    raise TypeError(f"{name} takes a set of nn.Module classes or a function module -> bool, got {policy!r}.")


def sharding_strategy_name(value: Any) -> str:
    """``"FULL_SHARD"`` etc. from a string or torch's ``ShardingStrategy``."""
    name = getattr(value, "name", value)
    if not isinstance(name, str) or name.upper() not in SHARDING_STRATEGIES:
        raise ValueError(f"sharding_strategy must be one of {', '.join(SHARDING_STRATEGIES)}, got {value!r}.")
    return name.upper()


class RayFSDPStrategy(RayWorkersMixin, ShardedWorkersMixin):
    """Fully sharded data parallel (FSDP2) across Ray actors; the module needs no ``configure_model``.

    Args:
        num_workers, num_cpus_per_worker, use_gpu, resources_per_worker, init_hook: as for ``RayStrategy``.
        auto_wrap_policy: layer classes (a set) or a function ``module -> bool``: the units of sharding.
        sharding_strategy: ``"FULL_SHARD"`` (default), ``"SHARD_GRAD_OP"``, ``"NO_SHARD"``, ``"HYBRID_SHARD"``
            (or torch's ``ShardingStrategy``).
        cpu_offload: keep parameters, gradients and optimizer state in CPU memory (``True`` or a ``CPUOffloadPolicy``).
        mixed_precision: a ``torch.distributed.fsdp.MixedPrecisionPolicy``.
        activation_checkpointing_policy: layer classes (a set) or a function whose activations are recomputed.
        state_dict_type: ``"full"`` (default): one checkpoint file written by rank 0; ``"sharded"``: a directory.
        full_weights_home, process_group_backend, timeout: as for ``RayModelParallelStrategy``.
        placement_timeout_s, worker_start_timeout_s, keep_workers_alive_s, progress_timeout_s: as for ``RayStrategy``.
        scale_up_timeout_s, max_failures, recovery_checkpoint_every_n_steps: as for ``RayStrategy``.
        **fsdp_kwargs: passed to every ``fully_shard`` call (e.g. ``reshard_after_forward``).

    Example::

        trainer = pl.Trainer(strategy=RayFSDPStrategy(num_workers=4, use_gpu=True,
                                                      auto_wrap_policy={TransformerBlock}))
        trainer.fit(model)  # the full trained weights are in `model` afterwards
    """

    registry_name = "fsdp_ray"
    lightning_base = "strategies.ModelParallelStrategy"

    @worker_arguments()
    def __init__(
        self,
        *,
        auto_wrap_policy: Any = None,
        sharding_strategy: Any = "FULL_SHARD",
        cpu_offload: Any = False,
        mixed_precision: Any = None,
        activation_checkpointing_policy: Any = None,
        state_dict_type: str = "full",
        full_weights_home: bool | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
        **fsdp_kwargs: Any,
    ) -> None:
        require_sharding_torch("RayFSDPStrategy", self.resources, process_group_backend)
        check_sharding_arguments(self.use_gpu, process_group_backend, timeout, full_weights_home)
        self._check_fsdp_arguments(cpu_offload, mixed_precision, state_dict_type, fsdp_kwargs)
        self.full_weights_home = full_weights_home
        self.wraps = module_selector("auto_wrap_policy", auto_wrap_policy)
        self.checkpoints_activations = module_selector(
            "activation_checkpointing_policy", activation_checkpointing_policy
        )
        self.sharding_strategy = sharding_strategy_name(sharding_strategy)
        self.cpu_offload = cpu_offload
        self.mixed_precision = mixed_precision
        self.state_dict_type = state_dict_type
        self.fsdp_kwargs = fsdp_kwargs
        super().__init__(
            data_parallel_size=self.num_workers,
            tensor_parallel_size=1,
            save_distributed_checkpoint=state_dict_type == "sharded",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    @staticmethod
    def _check_fsdp_arguments(cpu_offload: Any, mixed_precision: Any, state_dict_type: Any, kwargs: dict) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        if not isinstance(cpu_offload, (bool, CPUOffloadPolicy)):
            raise TypeError(f"cpu_offload takes True/False or a CPUOffloadPolicy, got {cpu_offload!r}.")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
            raise TypeError(
                "mixed_precision takes a torch.distributed.fsdp.MixedPrecisionPolicy (FSDP2's), e.g. "
                f"MixedPrecisionPolicy(param_dtype=torch.bfloat16), got {mixed_precision!r}."
            )
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type must be 'full' or 'sharded', got {state_dict_type!r}.")
        decided = {"mesh", "mp_policy", "offload_policy", "module"}
        accepted = set(inspect.signature(fully_shard).parameters) - decided
        check_keywords("RayFSDPStrategy", kwargs, accepted, "its own arguments and those of torch's fully_shard")

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank is data parallel, whatever the mesh's shape.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def check_trainer(self, trainer: pl.Trainer) -> None:
        self.decide_full_weights(trainer)

    @override
    def setup_environment(self) -> None:
        super(self.namespace.pl("strategies.ModelParallelStrategy"), self).setup_environment()
        self.join_process_group()
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = mesh_layout(self.sharding_strategy, self.world_size, self.num_processes, self.num_nodes)
        mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=names)
        _lightning.sharded.set_device_mesh(self, mesh)
        runtime.mark_progress("setup", "prepare_data, setup hooks, configure_model")

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # ModelParallelStrategy.setup without its demand for configure_model: this strategy shards.
        assert self.model is not None and self.accelerator is not None
        _lightning.sharded.evaluate_under_no_grad(trainer)
        self.accelerator.setup(trainer)
        self.shard(self.model)
        ns = self.namespace
        _lightning.sharded.materialize(ns, self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        fitting = trainer.state.fn == namespaces.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _lightning.sharded.optimizers_to_device(ns, self.optimizers, self.root_device)

    def shard(self, module: nn.Module, mesh: Any = None) -> nn.Module:
        """Activation checkpointing, then ``fully_shard`` on the policy's layers, the module's children, itself.

        ``mesh``: the device mesh to shard over (default the strategy's, in a worker's Trainer call).
        """
        from torch.distributed.fsdp import fully_shard

        if _is_sharded(module):
            return module  # sharded by the module's own configure_model
        if self.checkpoints_activations is not None:
            _torch.apply_activation_checkpointing(module, check_fn=self.checkpoints_activations)
        options = self._fully_shard_options(self.device_mesh if mesh is None else mesh)
        if self.wraps is not None:
            for layer in reversed(list(module.modules())):  # innermost first
                if layer is not module and self.wraps(layer) and not _is_sharded(layer):
                    fully_shard(layer, **options)
        for unit in _units(module):
            if any(not _is_dtensor(p) for p in unit.parameters()):
                fully_shard(unit, **options)
        if any(not _is_dtensor(p) for p in module.parameters(recurse=False)):
            fully_shard(module, **options)
        return module

    def _fully_shard_options(self, mesh: Any) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        offload = self.cpu_offload
        if offload is True:
            offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
        options: dict[str, Any] = {
            "mesh": mesh,
            "reshard_after_forward": self.sharding_strategy != "SHARD_GRAD_OP",
            "mp_policy": self.mixed_precision or MixedPrecisionPolicy(),
            "offload_policy": offload or OffloadPolicy(),
        }
        options.update(self.fsdp_kwargs)
        return options


def mesh_layout(
    sharding_strategy: str, world: int, per_node: int, num_nodes: int
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The mesh's shape and names: 1-D to shard over every rank; 2-D ``(replicate, shard)`` to replicate.

    ``per_node``: the workers on this rank's node; ``num_nodes``: the nodes the workers span.
    """
    if sharding_strategy == "NO_SHARD":
        return (world, 1), ("replicate", "shard")
    if sharding_strategy == "HYBRID_SHARD":
        if per_node * num_nodes != world:
            raise RuntimeError(
                "sharding_strategy='HYBRID_SHARD' shards within each node and needs as many workers on every "
                f"node, but Ray placed {world} workers on {num_nodes} nodes unevenly. Reserve whole nodes "
                "(resources_per_worker sized so that nodes fill evenly) or use 'FULL_SHARD'."
            )
        return (num_nodes, per_node), ("replicate", "shard")
    return (world,), ("data_parallel",)


def _units(module: nn.Module) -> list[nn.Module]:
    """The module's children, those of containers without a forward (ModuleList, ModuleDict) in their place."""
    units = []
    for child in module.children():
        if type(child).forward is nn.Module.forward:  # a container: FSDP hooks run on forward
            units.extend(_units(child))
        else:
            units.append(child)
    return units


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _is_sharded(module: nn.Module) -> bool:
    return any(_is_dtensor(p) for p in module.parameters())


class RayFSDPAccelerator(RayAccelerator):
    """Fully sharded data parallel on Ray actors: the classic form of :class:`RayFSDPStrategy`.

    Takes ``RayAccelerator``'s arguments and any other ``RayFSDPStrategy`` argument.

    Example::

        trainer = pl.Trainer(accelerator=RayFSDPAccelerator(num_workers=4, use_gpu=True, auto_wrap_policy={Block}))
    """

    strategy_class = RayFSDPStrategy


accelerator.register(RayFSDPAccelerator, "Fully sharded data parallel (FSDP2) on Ray actors")
