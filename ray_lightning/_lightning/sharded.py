"""Lightning's private names that the sharded strategies (``RayModelParallelStrategy``, ``RayFSDPStrategy``) use.

No public API does these jobs:

* ``ModelParallelStrategy._device_mesh`` and ``LightningModule._device_mesh``: where
  ``strategy.device_mesh`` and ``self.device_mesh`` (in ``configure_model``) read the mesh; the Ray
  strategy builds the mesh from where Ray placed its workers and stores it there, as Lightning's
  ``setup_environment`` does.
* ``ModelParallelStrategy._save_distributed_checkpoint``: whether checkpoints are sharded; a
  recovery checkpoint (one file the driver keeps) is taken with it switched off for a moment.
* fabric's ``_load_checkpoint`` (a sharded directory or a full file into a sharded module, any number
  of ranks) and ``_METADATA_FILENAME`` (the non-tensor part of a sharded checkpoint, ``meta.pt``).
* fabric's ``_materialize_distributed_module`` and ``_optimizers_to_device``: the steps of
  ``ModelParallelStrategy.setup`` after sharding, which ``RayFSDPStrategy`` runs after it shards.

Every one is in :data:`ray_lightning._lightning.PRIVATE_NAMES`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ray_lightning.namespaces import Namespace

MESH = "_device_mesh"
SAVE_DISTRIBUTED = "_save_distributed_checkpoint"
LOAD_CHECKPOINT = "strategies.model_parallel._load_checkpoint"  # fabric's
METADATA_FILENAME = "utilities.load._METADATA_FILENAME"  # fabric's
MATERIALIZE = "utilities.init._materialize_distributed_module"  # fabric's
OPTIMIZERS_TO_DEVICE = "utilities.optimizer._optimizers_to_device"  # fabric's


def set_device_mesh(strategy: Any, mesh: Any) -> None:
    """Make ``mesh`` the strategy's ``device_mesh`` and the module's ``self.device_mesh``."""
    setattr(strategy, MESH, mesh)
    setattr(strategy.lightning_module, MESH, mesh)


def saves_sharded_checkpoints(strategy: Any) -> bool:
    return bool(getattr(strategy, SAVE_DISTRIBUTED))


@contextlib.contextmanager
def full_checkpoints(strategy: Any) -> Iterator[None]:
    """For the block: the strategy's state dicts are full (gathered on rank 0), not sharded. Collective."""
    saved = getattr(strategy, SAVE_DISTRIBUTED)
    setattr(strategy, SAVE_DISTRIBUTED, False)
    try:
        yield
    finally:
        setattr(strategy, SAVE_DISTRIBUTED, saved)


def metadata_filename(ns: Namespace) -> str:
    return ns.fabric(METADATA_FILENAME)


def load_checkpoint(ns: Namespace, path: Path, state: dict[str, Any], strict: bool, weights_only: Any) -> dict:
    """A sharded directory or a full file into the sharded module and optimizers in ``state`` (every rank)."""
    load = ns.fabric(LOAD_CHECKPOINT)
    kwargs: dict[str, Any] = {"strict": strict, "optimizer_states_from_list": True}
    if "weights_only" in inspect.signature(load).parameters:  # Lightning 2.6
        kwargs["weights_only"] = weights_only
    return load(path=path, state=state, **kwargs)


def materialize(ns: Namespace, module: Any, device: Any) -> None:
    """Parameters left on the meta device (``empty_init``) get memory on ``device`` and their initial values."""
    ns.fabric(MATERIALIZE)(module, device)


def optimizers_to_device(ns: Namespace, optimizers: Any, device: Any) -> None:
    ns.fabric(OPTIMIZERS_TO_DEVICE)(optimizers, device)
