"""The sharded benchmark's workload and contenders: a stack of MLP blocks, sharded four ways on the same workers.

The data, the optimizer, the Trainer arguments and the step clock are :mod:`benchmarks.workload`'s;
the model is :class:`ShardedModule`, ``spec.blocks`` residual MLP blocks of width ``spec.hidden``,
each block one FSDP unit (``fully_shard``) in every contender.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from benchmarks.workload import BenchModule, Spec


@dataclass
class ShardedSpec(Spec):
    """:class:`~benchmarks.workload.Spec` plus the number of blocks and the device; the sizes of a real run."""

    features: int = 512
    hidden: int = 1024
    batch_size: int = 16
    steps: int = 12
    warmup: int = 4
    blocks: int = 16
    # Every contender trains on GPUs (one per worker) instead of CPUs.
    gpu: bool = False

    @classmethod
    def tiny(cls) -> ShardedSpec:
        """Sizes for the smoke test: every code path, seconds of compute."""
        return cls(features=32, hidden=64, classes=4, batch_size=16, steps=6, warmup=2, blocks=2, smoke=True)


class Block(nn.Module):
    """A residual MLP block (LayerNorm, Linear h→4h, GELU, Linear 4h→h): the unit of sharding."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ShardedModule(BenchModule):
    """:class:`BenchModule`'s classifier with ``spec.blocks`` blocks between its input and output layers.

    No ``configure_model``: ``RayFSDPStrategy`` (and Lightning's ``FSDPStrategy``) shard it themselves.
    """

    def __init__(self, spec: Spec) -> None:
        super().__init__(spec)
        torch.manual_seed(spec.seed)  # the same initial weights in every process (Lightning's ranks build their own)
        blocks = [Block(spec.hidden) for _ in range(getattr(spec, "blocks", 1))]
        self.net = nn.Sequential(nn.Linear(spec.features, spec.hidden), *blocks, nn.Linear(spec.hidden, spec.classes))


class SelfShardingModule(ShardedModule):
    """The same model, sharded by its own ``configure_model`` (``ModelParallelStrategy``s): the same units."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if any(_is_dtensor(p) for p in self.parameters()):
            return  # configure_model may run twice (fit after fit); shard once
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, Block):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


# -- The contenders -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardedContender:
    """One way to train :class:`ShardedModule` sharded: the Trainer's strategy arguments and the module's class."""

    name: str
    label: str
    strategy: Callable[[ShardedSpec], dict[str, Any]]
    module: type[ShardedModule]
    uses_ray: bool = True
    # Rank 0 is the driver process itself (Lightning's own launcher): it keeps its shard, nothing comes home.
    driver_is_rank_zero: bool = False
    # Lightning's FSDPStrategy (FSDP1) runs only on GPUs.
    needs_gpu: bool = False
    # The bare driver: the ray_fsdp driver with the blocks this narrow, a model of a few KB.
    shrink_to: int | None = None
    # The driver builds the module under trainer.init_module(empty_init=True): on the meta device, no weights.
    empty_init: bool = False
    note: str = ""

    def unavailable(self, spec: ShardedSpec) -> str | None:
        """Why this contender cannot run with ``spec`` on this machine; None when it can."""
        gpus = torch.cuda.device_count()
        if (self.needs_gpu or spec.gpu) and gpus < spec.workers:
            return f"needs {spec.workers} CUDA GPUs (one per worker), this machine has {gpus}"
        return None

    def module_spec(self, spec: ShardedSpec) -> ShardedSpec:
        """The sizes of the module this contender trains."""
        if self.shrink_to is None:
            return spec
        return dataclasses.replace(spec, features=self.shrink_to, hidden=self.shrink_to)


def _ray_fsdp(spec: ShardedSpec) -> dict[str, Any]:
    from ray_lightning import RayFSDPStrategy

    # full_weights_home=True: the weights come home whatever the shared machine's free memory is just then.
    strategy = RayFSDPStrategy(
        num_workers=spec.workers, use_gpu=spec.gpu, auto_wrap_policy={Block}, full_weights_home=True
    )
    return {"strategy": strategy}


def _ray_fsdp1(spec: ShardedSpec) -> dict[str, Any]:
    from ray_lightning import RayFSDP1Strategy

    strategy = RayFSDP1Strategy(num_workers=spec.workers, auto_wrap_policy={Block}, full_weights_home=True)
    return {"strategy": strategy}


def _ray_model_parallel(spec: ShardedSpec) -> dict[str, Any]:
    from ray_lightning import RayModelParallelStrategy

    strategy = RayModelParallelStrategy(
        num_workers=spec.workers, use_gpu=spec.gpu, data_parallel_size=spec.workers, tensor_parallel_size=1,
        full_weights_home=True,
    )  # fmt: skip
    return {"strategy": strategy}


def _device(spec: ShardedSpec) -> dict[str, Any]:
    return {"accelerator": "cuda" if spec.gpu else "cpu", "devices": spec.workers}


def _lightning_model_parallel(spec: ShardedSpec) -> dict[str, Any]:
    from benchmarks.workload import pl

    # Both sizes given: Lightning's "auto" would make the node's devices one tensor-parallel group.
    strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=spec.workers, tensor_parallel_size=1)
    return {"strategy": strategy, **_device(spec)}


def _lightning_fsdp(spec: ShardedSpec) -> dict[str, Any]:
    from benchmarks.workload import pl

    strategy = pl.strategies.FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full")
    return {"strategy": strategy, "accelerator": "cuda", "devices": spec.workers}


_RANK_ZERO_NOTE = (
    "launched as Lightning launches it (its subprocess-script launcher re-runs the driver's command line for "
    "rank 1); the driver is rank 0, trains, and holds only its shard after fit: no weights-home number, and its "
    "peak RSS includes training"
)
CONTENDERS: dict[str, ShardedContender] = {
    c.name: c
    for c in (
        ShardedContender("ray_fsdp", "ray_lightning RayFSDPStrategy", _ray_fsdp, ShardedModule,
                         note="auto_wrap_policy={Block}, the module has no configure_model"),
        ShardedContender("ray_fsdp_empty_init", "ray_lightning RayFSDPStrategy, empty_init", _ray_fsdp, ShardedModule,
                         empty_init=True, note="as ray_fsdp, the module built in `with trainer.init_module(empty_init="
                         "True)`, as README says to for big models: the driver holds no weights until the trained ones "
                         "arrive, the workers initialize theirs"),
        ShardedContender("ray_model_parallel", "ray_lightning RayModelParallelStrategy", _ray_model_parallel,
                         SelfShardingModule, note="the module's configure_model applies fully_shard per block"),
        ShardedContender("lightning_model_parallel", "Lightning ModelParallelStrategy (fully_shard)",
                         _lightning_model_parallel, SelfShardingModule, uses_ray=False, driver_is_rank_zero=True,
                         note=_RANK_ZERO_NOTE),
        ShardedContender("lightning_fsdp", "Lightning FSDPStrategy (FSDP1)", _lightning_fsdp, ShardedModule,
                         uses_ray=False, driver_is_rank_zero=True, needs_gpu=True,
                         note="GPUs only (torch's FSDP1 refuses CPUs); " + _RANK_ZERO_NOTE),
        ShardedContender("ray_fsdp1", "ray_lightning RayFSDP1Strategy (FSDP1)", _ray_fsdp1, ShardedModule,
                         needs_gpu=True, note="GPUs only, as Lightning's FSDPStrategy; auto_wrap_policy={Block}; its "
                         "step is judged against Lightning's FSDPStrategy"),
        ShardedContender("bare", "bare driver", _ray_fsdp, ShardedModule, shrink_to=16,
                         note="the ray_fsdp driver, the same imports, Ray connection and fit, with the blocks 16 "
                         "wide (a model of a few KB): what a driver costs without the model"),
    )
}  # fmt: skip
BASELINE = "lightning_model_parallel"
BARE = "bare"
# Judged against the goals (those that ran).
OURS = ("ray_fsdp", "ray_fsdp_empty_init", "ray_model_parallel", "ray_fsdp1")
# Whose step a contender's is judged against, where not BASELINE's: FSDP1 against FSDP1.
STEP_REFERENCE = {"ray_fsdp1": "lightning_fsdp"}
