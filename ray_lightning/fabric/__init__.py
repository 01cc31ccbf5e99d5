"""Lightning Fabric on Ray actors: ``Fabric(strategy=RayStrategy(...))`` and ``fabric.launch(train)``.

Example::

    import lightning as L
    from ray_lightning import RayStrategy

    def train(fabric, lr):
        model = Net()
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=lr))
        ...
        return {"loss": loss.item()}

    fabric = L.Fabric(strategy=RayStrategy(num_workers=4, use_gpu=True), precision="bf16-mixed")
    result = fabric.launch(train, 0.1)  # runs on 4 Ray actors; rank 0's return value

* :mod:`.strategies`: the Fabric forms of the Trainer strategies, and the conversion Fabric's connector calls.
* :mod:`.workers`: ``RayFabricWorkers``, what the Fabric forms share (the paths ``fabric.save`` uses in a worker).
* :mod:`.launcher`: ``RayFabricLauncher``, the Trainer's launcher called without a Trainer.

Importing ``ray_lightning`` installs the conversion and Fabric's registry names (:func:`install`).
"""

from ray_lightning import _lightning
from ray_lightning.fabric.launcher import RayFabricLauncher
from ray_lightning.fabric.strategies import (
    RayFabricDDPStrategy,
    RayFabricDeepSpeedStrategy,
    RayFabricFSDPStrategy,
    RayFabricModelParallelStrategy,
    for_fabric,
    register,
)
from ray_lightning.fabric.workers import RayFabricWorkers


def install() -> None:
    """Let every installed Fabric take ray_lightning's strategies (objects and registry names)."""
    _lightning.fabric.install_connector(for_fabric)
    register()


__all__ = [
    "RayFabricDDPStrategy",
    "RayFabricDeepSpeedStrategy",
    "RayFabricFSDPStrategy",
    "RayFabricLauncher",
    "RayFabricModelParallelStrategy",
    "RayFabricWorkers",
    "install",
]
