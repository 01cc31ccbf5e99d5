"""Train a PyTorch Lightning module on Ray actors with DDP or Horovod.

Example::

    import pytorch_lightning as pl
    from ray_lightning import HorovodRayAccelerator, RayAccelerator, RayStrategy

    trainer = pl.Trainer(max_epochs=4, strategy=RayStrategy(num_workers=4))
    # or, the classic form:
    trainer = pl.Trainer(max_epochs=4, accelerator=RayAccelerator(num_workers=4, cpus_per_worker=1))
    # or Horovod (needs Horovod installed):
    trainer = pl.Trainer(max_epochs=4, accelerator=HorovodRayAccelerator(num_hosts=2, num_slots=4))
    trainer.fit(model)

The package's layers, lowest first (each imports only those below it; ``tests/test_layers.py``):
``namespaces``, ``errors``, ``config``, ``environment``, ``runtime``, ``_torch``, ``_ray``, ``_lightning``,
``channel``, ``home``, ``data``, ``launch``, ``strategies``, ``fabric``, ``horovod``, ``tune``. Ray Data comes in
through :class:`ray_lightning.data.RayDataModule`; Lightning Fabric through :mod:`ray_lightning.fabric`.

Where to look: a worker is started in :mod:`ray_lightning.launch.worker_group`; ranks come from
:mod:`ray_lightning.environment`; a restart is decided in :mod:`ray_lightning.launch.failures`; results
return through :mod:`ray_lightning.home.results`.
"""

import os as _os

from ray_lightning.launch import priority as _priority  # imports only os and logging

if _os.environ.get("RAY_LIGHTNING_IMPORT_NICENESS"):
    # A spare worker process (launch.worker_group) starts at Ray's niceness 15 with nothing to run before this
    # import: it imports torch and Lightning (seconds of CPU) at the driver's niceness, or training on every core
    # would starve it, and takes Ray's back once done (below).
    _priority.hold(int(_os.environ["RAY_LIGHTNING_IMPORT_NICENESS"]))

# First: with neither Lightning installed, this raises an ImportError that says what to install.
from ray_lightning import namespaces  # noqa: F401, I001
from ray_lightning import _lightning
from ray_lightning.environment import RayEnvironment
from ray_lightning.errors import ClusterResourceError, RayWorkerError, StorageError, WorkerHangError
from ray_lightning import fabric
from ray_lightning.horovod.strategy import HorovodRayAccelerator, HorovodRayStrategy
from ray_lightning.launch.idle_pool import release_idle_workers
from ray_lightning.strategies.ddp import RayAccelerator, RayStrategy
from ray_lightning.strategies.deepspeed import RayDeepSpeedAccelerator, RayDeepSpeedStrategy
from ray_lightning.strategies.fsdp import RayFSDPAccelerator, RayFSDPStrategy
from ray_lightning.strategies.fsdp1 import RayFSDP1Accelerator, RayFSDP1Strategy
from ray_lightning.strategies.model_parallel import RayModelParallelAccelerator, RayModelParallelStrategy

__version__ = "0.6.0"

_priority.release()  # nothing held outside a spare's process

_lightning.install()
fabric.install()

__all__ = [
    "ClusterResourceError",
    "HorovodRayAccelerator",
    "HorovodRayStrategy",
    "RayAccelerator",
    "RayDeepSpeedAccelerator",
    "RayDeepSpeedStrategy",
    "RayEnvironment",
    "RayFSDP1Accelerator",
    "RayFSDP1Strategy",
    "RayFSDPAccelerator",
    "RayModelParallelAccelerator",
    "RayFSDPStrategy",
    "RayModelParallelStrategy",
    "RayStrategy",
    "RayWorkerError",
    "StorageError",
    "WorkerHangError",
    "__version__",
    "release_idle_workers",
]
