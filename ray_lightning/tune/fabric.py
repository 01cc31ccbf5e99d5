"""Reporting to Tune from inside ``fabric.launch(train)`` in a trial."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ray_lightning import runtime
from ray_lightning.channel.driver_channel import ask_driver
from ray_lightning.tune import trial
from ray_lightning.tune.callbacks import plain


def report(fabric: Any, metrics: Mapping[str, Any], checkpoint_path: str | None = None) -> bool:
    """Report to Ray Tune from inside ``fabric.launch(train)`` in a trial; every rank calls it at the same point.

    Rank 0's ``metrics`` (and the checkpoint file it wrote at ``checkpoint_path``, e.g. with ``fabric.save``)
    go to the trial's process, which reports them to Tune; each call is one ``training_iteration``.

    Args:
        fabric: the ``Fabric`` object the launched function was given.
        metrics: plain numbers (tensors of one element are converted) by name.
        checkpoint_path: a file rank 0 can read (a full, not a sharded, checkpoint), reported with the metrics;
            it reaches Tune's storage from any node. Tune's ``get_checkpoint()`` in the trial's function then
            holds it under its own name.

    Returns:
        True on every rank when Tune has stopped the trial (a scheduler's decision): leave the training loop.

    Example::

        def train(fabric, config):
            ...
            for epoch in range(10):
                ...
                fabric.save("last.ckpt", {"model": model, "optimizer": optimizer})
                if ray_lightning.tune.report(fabric, {"loss": loss.item()}, checkpoint_path="last.ckpt"):
                    break

        def trial(config):
            L.Fabric(strategy=RayStrategy(num_workers=2)).launch(train, config)
    """
    stopped = False
    if fabric.global_rank == 0:
        numbers = {name: plain(value) for name, value in metrics.items()}
        checkpoint = None
        if checkpoint_path is not None:
            if not os.path.isfile(checkpoint_path):
                raise FileNotFoundError(f"checkpoint_path={checkpoint_path!r} is not a file rank 0 can read.")
            with open(checkpoint_path, "rb") as f:
                checkpoint = (os.path.basename(checkpoint_path), f.read())
        stopped = ask_driver(trial.report_to_tune, numbers, checkpoint, runtime.current_context() is not None)
    if fabric.world_size > 1:
        stopped = fabric.broadcast(stopped, src=0)
    return bool(stopped)
