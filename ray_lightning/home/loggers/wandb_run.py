"""``WandbLogger``: one W&B run per ``fit``, started (or resumed) by rank 0 with the driver's run id.

Driver, before the call (:func:`prepare`, :func:`ship`): a run the driver holds (``logger.experiment``
was used, e.g. ``config.update``, or ``wandb.init`` was called before) is handed over: its id,
project, entity, name and config become rank 0's ``wandb.init`` arguments, and it is finished. A
logger without a run gets its id now (``id``/``version``, ``WANDB_RUN_ID``, or a new one), so
``logger.version`` is the run's id before, during and after the call. The logger is then pickled
without a run (:func:`ray_lightning._lightning.loggers.ship`).

Worker (:func:`enter`, :func:`finish`): ``wandb.init`` writes under the logger's ``save_dir`` (the
staged one when rank 0 is off the driver's machine); after the Trainer function returned (after
``logger.finalize``, which logs ``log_model=True`` checkpoints), rank 0 finishes the run and waits
for W&B's service to write everything (``wandb.teardown``), so the run directory is complete
before it is collected.

Driver, after the call (:func:`arriving_files`): a staged run directory named like one the driver
already has (W&B names them by the second the run started) gets a suffix instead of overwriting it.
"""

from __future__ import annotations

import os
import re
import secrets
import string
import sys
from typing import Any

from ray_lightning._lightning import loggers as lightning

_ID_ALPHABET = string.ascii_lowercase + string.digits


def new_run_id() -> str:
    """A run id as W&B makes them (8 characters of ``[a-z0-9]``)."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))


def prepare(logger: Any) -> None:
    """On the driver, before the logger is pickled: no live run here, the run id fixed."""
    run = lightning.live_run(logger) or _global_run()
    if run is not None:
        _hand_over(logger, run)
    run_id = lightning.wandb_run_id(logger) or os.environ.get("WANDB_RUN_ID") or new_run_id()
    lightning.set_wandb_run_id(logger, run_id)
    arguments = lightning.wandb_init_arguments(logger)
    if arguments.get("resume") is None:
        arguments["resume"] = "allow"  # the next fit continues the run (Lightning's default)


def ship(logger: Any) -> None:
    """After the directories were made absolute: pickle the logger without a run."""
    if logger.save_dir is not None:
        lightning.wandb_init_arguments(logger)["dir"] = logger.save_dir
    lightning.ship(logger)


def _global_run() -> Any:
    """The run ``wandb.init`` started in this process, which ``logger.experiment`` would adopt."""
    wandb = sys.modules.get("wandb")
    return getattr(wandb, "run", None)


def _hand_over(logger: Any, run: Any) -> None:
    """Rank 0 continues ``run``: its id, project, entity, name and config; the driver finishes it."""
    arguments = lightning.wandb_init_arguments(logger)
    lightning.set_wandb_run_id(logger, run.id)
    for key in ("project", "entity", "name"):
        value = getattr(run, key, None)
        if value:
            arguments[key] = value
    config = {k: v for k, v in run.config.as_dict().items() if not k.startswith("_wandb")}
    if config:
        arguments["config"] = config
    run.finish()
    lightning.forget_run(logger)


def enter(logger: Any, rank_zero: bool) -> None:
    """In a worker, before the Trainer function: the run is written under the (staged) ``save_dir``."""
    save_dir = logger.save_dir
    if save_dir is not None:
        lightning.wandb_init_arguments(logger)["dir"] = save_dir
        if rank_zero:
            os.makedirs(save_dir, exist_ok=True)


def finish(wandb_loggers: list[Any], failed: bool) -> None:
    """In rank 0, after the Trainer function: finish the runs and wait until their files are written.

    ``run.finish()`` returns before W&B's service has flushed the run file; ``wandb.teardown()``
    waits for the service to exit. The next call of a reused worker starts a new service.
    """
    finished = False
    for logger in wandb_loggers:
        run = lightning.live_run(logger)
        if run is None:
            continue
        lightning.forget_run(logger)
        run.finish(exit_code=1 if failed else 0)
        finished = True
    if finished:
        import wandb

        wandb.teardown()


def _run_directory_pattern(run_id: str) -> re.Pattern[str]:
    # wandb/run-20260101_120000-<id> (online), wandb/offline-run-...-<id>, maybe with a -N suffix
    return re.compile(rf"(offline-)?run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")


def arriving_files(logger: Any, files: dict[str, bytes]) -> dict[str, bytes]:
    """``files`` (rank 0's, staged) with run directories the driver already has renamed ``<name>-<n>``."""
    if logger.save_dir is None or lightning.wandb_run_id(logger) is None:
        return files
    runs = os.path.join(logger.save_dir, "wandb")
    pattern = _run_directory_pattern(lightning.wandb_run_id(logger))
    renamed: dict[str, str] = {}
    for path in files:
        name = os.path.relpath(path, runs).split(os.sep)[0]
        if name not in renamed and pattern.fullmatch(name) and os.path.isdir(os.path.join(runs, name)):
            renamed[name] = _free_name(runs, name)
    if not renamed:
        return files
    result = {}
    for path, data in files.items():
        parts = os.path.relpath(path, runs).split(os.sep)
        if parts[0] in renamed:
            path = os.path.join(runs, renamed[parts[0]], *parts[1:])
        result[path] = data
    return result


def _free_name(directory: str, name: str) -> str:
    suffix = 1
    while os.path.exists(os.path.join(directory, f"{name}-{suffix}")):
        suffix += 1
    return f"{name}-{suffix}"
