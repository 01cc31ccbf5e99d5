"""``RayFabricLauncher``: what ``fabric.launch(fn, *args)`` calls: ``fn(fabric, *args)`` on every Ray actor.

It is the Trainer's :class:`~ray_lightning.launch.launcher.RayLauncher` (placement, warm workers, the
watchdog, restarts, output, errors with rank and traceback) called without a Trainer; before it launches,
the Fabric strategy learns the driver's working directory (the workers resolve relative paths against it),
with ``storage_path`` the run's folder (relative paths of ``fabric.save``/``fabric.load`` and the loggers go
there), and the Fabric's loggers (rank 0 off this machine writes their directories under its staging
directory).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from typing_extensions import override

from ray_lightning import _lightning
from ray_lightning.home import loggers, storage
from ray_lightning.launch.launcher import RayLauncher


class RayFabricLauncher(RayLauncher):
    """Runs ``fabric.launch(fn, *args)`` on the strategy's Ray actors; returns rank 0's return value."""

    @override
    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:  # every keyword is the function's
        if _lightning.fabric.is_argumentless_launch(function):
            raise RuntimeError(
                "fabric.launch() without a function cannot run on Ray actors: Fabric's own launchers re-run this "
                "script in each process, which Ray workers do not do (the script may be a notebook, or run under "
                "Ray Client). Put the training code in a function that takes the Fabric object and call "
                "fabric.launch(train, *args): it runs on every worker and returns rank 0's return value here."
            )
        fabric = args[0] if args else None
        strategy = self._strategy
        strategy.driver_cwd = os.getcwd()
        settings = strategy.workers.storage
        strategy.run_url = storage.join(settings.path, strategy.run_name_now()) if settings.enabled else None
        strategy.loggers = list(getattr(fabric, "loggers", []))
        loggers.prepare_fabric_on_driver(strategy.loggers, strategy.run_url)
        return self.run_call(function, args, kwargs, None)
