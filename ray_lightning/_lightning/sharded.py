"""Lightning's private names the sharded strategies use (``RayModelParallelStrategy``, ``RayFSDPStrategy``, FSDP1's).

No public API does these jobs:

* ``ModelParallelStrategy._device_mesh`` and ``LightningModule._device_mesh``: where
  ``strategy.device_mesh`` and ``self.device_mesh`` (in ``configure_model``) read the mesh; the Ray
  strategy builds the mesh from where Ray placed its workers and stores it there, as Lightning's
  ``setup_environment`` does.
* ``ModelParallelStrategy._save_distributed_checkpoint`` and ``FSDPStrategy._state_dict_type``:
  whether checkpoints are sharded; a recovery or Tune checkpoint (one file the driver keeps) is
  taken with them set to full for a moment.
* fabric's ``_load_checkpoint`` (a sharded directory or a full file into a sharded module, any number
  of ranks) and ``_METADATA_FILENAME`` (the non-tensor part of a sharded checkpoint, ``meta.pt``).
* fabric's ``_rekey_optimizer_state_if_needed``, which ``_load_checkpoint`` calls on a full
  checkpoint: it fails (``IndexError``) on an optimizer without state (plain SGD has none); while
  loading, it is replaced by one that also handles that (Lightning 2.4-2.6 all have the bug).
* fabric's ``_materialize_distributed_module`` and ``_optimizers_to_device``: the steps of
  ``ModelParallelStrategy.setup`` after sharding, which ``RayFSDPStrategy`` runs after it shards.
* The evaluation loops' ``inference_mode`` (``_EvaluationLoop``, ``_PredictionLoop``): FSDP2's
  unsharded parameters made under ``torch.inference_mode`` fail its next forward ("Inference tensors
  do not track version counter", torch 2.11 on CUDA). Lightning evaluates FSDP1 under ``no_grad`` for
  the same reason (pytorch/pytorch#95957) but not ``ModelParallelStrategy``; a sharded Ray strategy's
  loops use ``no_grad`` too. On CPU (gloo) Lightning already uses ``no_grad``.

Every one is in :data:`ray_lightning._lightning.PRIVATE_NAMES`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ray_lightning.namespaces import Namespace

MESH = "_device_mesh"
SAVE_DISTRIBUTED = "_save_distributed_checkpoint"
STATE_DICT_TYPE = "_state_dict_type"  # FSDPStrategy's (FSDP1): "full" or "sharded"
LOAD_CHECKPOINT = "strategies.model_parallel._load_checkpoint"  # fabric's
REKEY = "strategies.model_parallel._rekey_optimizer_state_if_needed"  # fabric's
METADATA_FILENAME = "utilities.load._METADATA_FILENAME"  # fabric's
MATERIALIZE = "utilities.init._materialize_distributed_module"  # fabric's
OPTIMIZERS_TO_DEVICE = "utilities.optimizer._optimizers_to_device"  # fabric's
INFERENCE_MODE = "inference_mode"  # of the Trainer's evaluation and prediction loops
EVALUATION_LOOPS = ("fit_loop.epoch_loop.val_loop", "validate_loop", "test_loop", "predict_loop")


def set_device_mesh(strategy: Any, mesh: Any) -> None:
    """Make ``mesh`` the strategy's ``device_mesh`` and the module's ``self.device_mesh``."""
    set_strategy_mesh(strategy, mesh)
    setattr(strategy.lightning_module, MESH, mesh)


def set_strategy_mesh(strategy: Any, mesh: Any) -> None:
    """Make ``mesh`` the ``device_mesh`` of a ``ModelParallelStrategy`` (the Trainer's or Fabric's)."""
    setattr(strategy, MESH, mesh)


def saves_sharded_checkpoints(strategy: Any) -> bool:
    return bool(getattr(strategy, SAVE_DISTRIBUTED))


def full_checkpoints(strategy: Any) -> contextlib.AbstractContextManager[None]:
    """For the block: the strategy's state dicts are full (gathered on rank 0), not sharded. Collective."""
    # ModelParallelStrategy's switch, or FSDPStrategy's state_dict_type.
    if hasattr(strategy, SAVE_DISTRIBUTED):
        return _switched(strategy, SAVE_DISTRIBUTED, False)
    return _switched(strategy, STATE_DICT_TYPE, "full")


def sharded_checkpoints(strategy: Any) -> contextlib.AbstractContextManager[None]:
    """For the block: a ``ModelParallelStrategy``'s state dicts are sharded (each rank its part). Not collective."""
    return _switched(strategy, SAVE_DISTRIBUTED, True)


@contextlib.contextmanager
def _switched(strategy: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(strategy, name)
    setattr(strategy, name, value)
    try:
        yield
    finally:
        setattr(strategy, name, saved)


def evaluate_under_no_grad(trainer: Any) -> None:
    """The trainer's validation, test and predict loops run under ``torch.no_grad``, not ``inference_mode``."""
    for path in EVALUATION_LOOPS:
        loop = functools.reduce(getattr, path.split("."), trainer)
        setattr(loop, INFERENCE_MODE, False)


def metadata_filename(ns: Namespace) -> str:
    return ns.fabric(METADATA_FILENAME)


def load_checkpoint(ns: Namespace, path: Path, state: dict[str, Any], strict: bool, weights_only: Any) -> dict:
    """A sharded directory or a full file into the sharded module and optimizers in ``state`` (every rank).

    Optimizers without state (plain SGD) in a full file get only their hyperparameters (``lr``...):
    torch's ``set_optimizer_state_dict`` cannot load an empty state from rank 0 ("Expected device to be set").
    """
    stateless = _stateless_optimizers(path, state)
    state = {k: v for k, v in state.items() if k not in stateless}
    checkpoint = _load(ns, path, state, strict, weights_only)
    for key, optimizer in stateless.items():
        saved = checkpoint["optimizer_states"][int(key.removeprefix("optimizer_"))]["param_groups"]
        for group, saved_group in zip(optimizer.param_groups, saved):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
    return checkpoint


def _stateless_optimizers(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """The optimizers of ``state`` (``optimizer_<i>``) whose state a full checkpoint file holds empty, when all are."""
    import torch

    optimizers = {k: v for k, v in state.items() if k.startswith("optimizer_")}
    if not optimizers or not path.is_file():
        return {}
    saved = torch.load(path, mmap=True, map_location="cpu", weights_only=False).get("optimizer_states", [])
    if len(saved) < len(optimizers) or any(s.get("state") for s in saved):
        return {}  # some have state: fabric loads them all (its indices count every optimizer)
    return optimizers


def _load(ns: Namespace, path: Path, state: dict[str, Any], strict: bool, weights_only: Any) -> dict:
    load = ns.fabric(LOAD_CHECKPOINT)
    kwargs: dict[str, Any] = {"strict": strict, "optimizer_states_from_list": True}
    if "weights_only" in inspect.signature(load).parameters:  # Lightning 2.6
        kwargs["weights_only"] = weights_only
    module_name, _, name = f"{ns.fabric_package}.{REKEY}".rpartition(".")
    owner = importlib.import_module(module_name)
    original = getattr(owner, name)
    setattr(owner, name, functools.partial(_rekey_even_without_state, original))
    try:
        return load(path=path, state=state, **kwargs)
    finally:
        setattr(owner, name, original)


def _rekey_even_without_state(original: Any, optimizer_state: dict[str, Any], module: Any) -> dict[str, Any]:
    """fabric's re-keying of a full checkpoint's optimizer state by parameter name, also without any state."""
    if optimizer_state.get("state"):
        return original(optimizer_state, module)
    from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

    groups = optimizer_state.get("param_groups") or [{}]
    if any(isinstance(p, int) for p in groups[0].get("params", [])):
        return FullyShardedDataParallel.rekey_optim_state_dict(optimizer_state, OptimStateKeyType.PARAM_NAME, module)
    return optimizer_state


def materialize(ns: Namespace, module: Any, device: Any) -> None:
    """Parameters left on the meta device (``empty_init``) get memory on ``device`` and their initial values."""
    ns.fabric(MATERIALIZE)(module, device)


def optimizers_to_device(ns: Namespace, optimizers: Any, device: Any) -> None:
    ns.fabric(OPTIMIZERS_TO_DEVICE)(optimizers, device)
