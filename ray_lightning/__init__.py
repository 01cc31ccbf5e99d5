"""Train a PyTorch Lightning module on Ray actors with DDP.

Example::

    import pytorch_lightning as pl
    from ray_lightning import RayStrategy, RayAccelerator

    trainer = pl.Trainer(max_epochs=4, strategy=RayStrategy(num_workers=4))
    # or, the classic form:
    trainer = pl.Trainer(max_epochs=4, accelerator=RayAccelerator(num_workers=4, cpus_per_worker=1))
    trainer.fit(model)
"""

from ray_lightning import accelerator_hook
from ray_lightning.accelerator import RayAccelerator
from ray_lightning.environment import RayEnvironment
from ray_lightning.launcher import RayWorkerError
from ray_lightning.resources import ClusterResourceError
from ray_lightning.strategy import RayStrategy

__version__ = "0.4.0"

accelerator_hook.install()

__all__ = [
    "ClusterResourceError",
    "RayAccelerator",
    "RayEnvironment",
    "RayStrategy",
    "RayWorkerError",
    "__version__",
]
