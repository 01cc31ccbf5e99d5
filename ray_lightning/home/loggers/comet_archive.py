"""``CometLogger``: rank 0 continues the driver's experiment by its key and ends its copy after the call.

The driver's logger starts its experiment when it is made (Lightning's) and keeps it; rank 0's
copy of the logger starts one with the same key (``comet_ml.start``, ``get_or_create``). Online,
both log to the one experiment; offline, each process writes its own archive of it, which Comet
merges on upload. Lightning's ``finalize`` only flushes, and an actor waiting for the next call
never exits, so rank 0 ends its experiment after the Trainer function (:func:`end`): its offline
archive is written into the offline directory, staged when rank 0 is off the driver's machine,
and comes home.
"""

from __future__ import annotations

import os
from typing import Any

from ray_lightning._lightning import loggers as lightning
from ray_lightning.home import files


def prepare(logger: Any) -> None:
    """On the driver: the offline directory is the driver's, absolute (Comet's default is relative)."""
    config = lightning.comet_config(logger)
    directory = getattr(config, "offline_directory", None)
    if directory:
        config.offline_directory = os.path.abspath(os.path.expanduser(directory))


def enter(logger: Any, staging: str | None, rank_zero: bool) -> None:
    """In a worker, before the Trainer function: rank 0 off the driver's machine archives under staging."""
    config = lightning.comet_config(logger)
    directory = getattr(config, "offline_directory", None)
    if staging is not None and rank_zero and directory and os.path.isabs(directory):
        config.offline_directory = files.to_staged(directory, staging)


def end(comet_loggers: list[Any]) -> None:
    """In rank 0, after the Trainer function: end its experiments (an offline one writes its archive)."""
    for logger in comet_loggers:
        experiment = lightning.live_run(logger)
        if experiment is not None:
            lightning.forget_run(logger)
            experiment.end()
