"""Reporting to Tune from inside ``fabric.launch(train)`` in a trial."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from typing import Any

from ray_lightning import runtime
from ray_lightning.channel.driver_channel import ask_driver
from ray_lightning.home import storage
from ray_lightning.tune import trial
from ray_lightning.tune.callbacks import plain


def report(fabric: Any, metrics: Mapping[str, Any], checkpoint_path: str | None = None) -> bool:
    """Report to Ray Tune from inside ``fabric.launch(train)`` in a trial; every rank calls it at the same point.

    Rank 0's ``metrics`` go to the trial's process, which reports them to Tune; each call is one
    ``training_iteration``. The checkpoint file rank 0 wrote at ``checkpoint_path`` (e.g. with ``fabric.save``) is
    copied by rank 0 into the folder Tune keeps it in (through the trial's process only where Tune's storage is
    not reachable from the workers, with a warning).

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
            checkpoint = _copied_into_tune_storage(checkpoint_path) or _as_bytes(checkpoint_path)
        stopped = ask_driver(trial.report_to_tune, numbers, checkpoint, runtime.current_context() is not None)
    if fabric.world_size > 1:
        stopped = fabric.broadcast(stopped, src=0)
    return bool(stopped)


def _copied_into_tune_storage(path: str) -> tuple[str, None] | None:
    """Rank 0 copies its checkpoint file into the folder Tune keeps the next checkpoint in (fsspec streams it);
    None where Tune's storage is not reachable so, or the trial's process does not see the copy.

    Growth law: per report, three small requests from rank 0 to the trial's process; the file's bytes go from rank
    0 to storage once, none through the trial's process, whatever the checkpoint's size.
    """
    folder = ask_driver(trial.folder_for_rank_zero)
    if folder is None:
        return None
    name = os.path.basename(path)
    target = storage.join(folder, name)
    fs, inside = storage.filesystem(target)
    fs.makedirs(posixpath.dirname(inside), exist_ok=True)
    fs.put_file(path, inside)
    return (name, None) if ask_driver(trial.sees_rank_zeros_copy, target) else None


def _as_bytes(path: str) -> tuple[str, bytes]:
    with open(path, "rb") as f:
        return os.path.basename(path), f.read()
