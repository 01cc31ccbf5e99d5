"""Loggers whose runs live outside their log directory (W&B, MLflow, Comet) on Ray workers.

Rank 0 logs, as under Lightning's DDP; the driver's logger holds the same run before and after
``fit``, and what rank 0 wrote locally (W&B's offline runs, MLflow's file store, Comet's offline
archives) comes home with its other files (:mod:`ray_lightning.home.files`).

* Driver, before the payload is pickled: :func:`prepare_on_driver`.
* Worker, around the Trainer function: :func:`in_worker` (rank 0 closes its runs before its files
  are collected).
* Rank 0's output and the driver after the call: :func:`states_for_driver`, :func:`load_states`,
  :func:`arriving_files`.

Decisions:

* W&B: the driver holds no live run while rank 0 trains; rank 0 starts the run with the driver's
  id (``resume="allow"``) and finishes it (:mod:`.wandb_run`). Attaching rank 0 to the driver's run
  (Lightning's ``ddp_spawn`` way, through ``WANDB_SERVICE``) works only on the driver's machine
  with the driver alive and reachable: never on another node, under Ray Client, or when the
  driver cannot be reached. Rank 0 running a second live run beside the driver's would put two
  writers on one online run and keep the driver's config out of rank 0's offline run. So a run
  the driver already holds (``logger.experiment.config.update(...)`` before ``fit``) is finished
  and handed over with its config. Offline, each call adds one run directory with the same id
  (``wandb sync`` uploads them in order); online, W&B resumes the run. Needs no shared
  filesystem and no connection to the driver.
* W&B: rank 0 finishes its run after the Trainer function returns, not in a callback: Lightning
  calls ``logger.finalize`` (where ``log_model=True`` logs the checkpoints) after the callbacks'
  ``teardown``. It then waits for W&B's service (``wandb.teardown``): ``run.finish()`` returns before
  the run file is written, and the staging directory is collected right after.
* ``WANDB_SERVICE`` (the driver's W&B service socket) never reaches a worker: it is not forwarded,
  and a worker that inherited it (a local Ray started after ``wandb.init``) drops it for the call.
* ``WANDB_*``, ``MLFLOW_*`` and ``COMET_*`` variables are forwarded to the workers
  (:data:`ray_lightning.launch.contexts.FORWARDED_ENV_PREFIXES`), as Lightning's DDP processes inherit them:
  ``WANDB_MODE=offline``, ``MLFLOW_ALLOW_FILE_STORE`` and API keys set on the driver hold on
  every node.
* MLflow: the driver creates the run (as before); a local store is made absolute, and a rank 0
  off the driver's machine logs into a staged copy of the run that comes home (:mod:`.mlflow_store`).
* Comet: the driver keeps its experiment; rank 0 continues it by key and ends its own copy after
  the Trainer function, so an offline archive is written before its files are collected
  (:mod:`.comet_archive`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ray_lightning import _lightning, namespaces
from ray_lightning._lightning import loggers as lightning
from ray_lightning.config.variables import NOT_FORWARDED_ENV
from ray_lightning.home import files, storage
from ray_lightning.home.loggers import comet_archive, mlflow_store, wandb_run

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)
# The logger classes of every installed Lightning namespace, for isinstance.
WandbLogger = namespaces.every("loggers.WandbLogger")
MLFlowLogger = namespaces.every("loggers.MLFlowLogger")
CometLogger = namespaces.every("loggers.CometLogger")


def prepare_on_driver(trainer: pl.Trainer) -> None:
    """On the driver, before the Trainer is pickled: where rank 0 writes, and which runs it continues."""
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            wandb_run.prepare(logger)
        elif isinstance(logger, MLFlowLogger):
            mlflow_store.make_absolute(logger)
        elif isinstance(logger, CometLogger):
            comet_archive.prepare(logger)
    for logger in trainer.loggers:
        # Fix the version (lightning_logs/version_3, the MLflow run) here, so rank 0 writes where
        # `trainer.logger.log_dir` points on the driver afterwards.
        _ = logger.version
    files.make_absolute(trainer)
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            wandb_run.ship(logger)
        elif isinstance(logger, MLFlowLogger):
            mlflow_store.ship(logger)


@contextlib.contextmanager
def in_worker(trainer: pl.Trainer, staging: str | None) -> Iterator[None]:
    """Around the Trainer function in a worker (after :func:`ray_lightning.home.files.stage`).

    Before: the loggers write where this worker can (the staged directories), without the
    driver's W&B service. After, in rank 0: its W&B runs are finished and its Comet experiments
    ended (failed ones too), so that their files are complete when they are collected.
    """
    for name in NOT_FORWARDED_ENV:
        os.environ.pop(name, None)  # the call's environment is restored afterwards (WorkerCall.finish)
    rank_zero = trainer.global_rank == 0
    staged_runs = []
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            wandb_run.enter(logger, rank_zero)
        elif isinstance(logger, MLFlowLogger):
            staged_runs.append(mlflow_store.enter(logger, staging, rank_zero))
        elif isinstance(logger, CometLogger):
            comet_archive.enter(logger, staging, rank_zero)
    try:
        yield
    except BaseException:
        if rank_zero:
            try:
                _close(trainer, staged_runs, failed=True)
            except Exception:  # the call's own failure is what the driver must see; this one is logged
                log.exception("ray_lightning: could not close rank 0's loggers after the failure")
        raise
    if rank_zero:
        _close(trainer, staged_runs, failed=False)


def _close(trainer: pl.Trainer, staged_runs: list[mlflow_store.StagedRun | None], failed: bool) -> None:
    wandb_run.finish([lg for lg in trainer.loggers if isinstance(lg, WandbLogger)], failed)
    comet_archive.end([lg for lg in trainer.loggers if isinstance(lg, CometLogger)])
    for staged in staged_runs:
        if staged is not None:
            mlflow_store.leave(staged)


def continue_logs(trainer: pl.Trainer, before_step: int | None) -> None:
    """In rank 0 of a restarted fit: keep what the loggers wrote before the restart (CSV rows
    logged before step ``before_step``; the later ones are logged again)."""
    for logger in trainer.loggers:
        if isinstance(logger, namespaces.every("loggers.CSVLogger")):
            lightning.continue_csv_log(logger, before_step)


def prepare_fabric_on_driver(fabric_loggers: list[Any], run_url: str | None) -> None:
    """On the driver, before ``fabric.launch``: Fabric's loggers' relative directories made absolute (the driver's
    meaning of ``"logs"``), or with ``storage_path`` placed in the run's folder ``run_url``; then their versions
    fixed, so that a rerun after a restart writes into the same version."""
    if run_url is None:
        files.map_logger_paths(fabric_loggers, lambda p: os.path.abspath(os.path.expanduser(p)))
    else:
        files.map_logger_paths(fabric_loggers, lambda p: p if os.path.isabs(p) else storage.join(run_url, p))
        _lightning.use_filesystems_of_logger_paths(fabric_loggers)
    for logger in fabric_loggers:
        _ = logger.version


def continue_fabric_logs(fabric_loggers: list[Any]) -> None:
    """In rank 0 of a function Fabric launched, run again after a restart: keep the CSV rows the first run wrote
    (the function continues from what it loads, and may log its last steps again)."""
    for logger in fabric_loggers:
        if isinstance(logger, namespaces.every("loggers.CSVLogger", fabric=True)):
            lightning.continue_csv_log(logger, None)


def states_for_driver(trainer: pl.Trainer, staging: str | None) -> list[dict[str, Any]]:
    """In rank 0: what each logger's copy on the driver takes over (checkpoints logged as artifacts)."""
    states = [lightning.state_for_driver(logger) for logger in trainer.loggers]
    return [files.from_staged(state, staging) if staging is not None else state for state in states]


def load_states(trainer: pl.Trainer, states: list[dict[str, Any]]) -> None:
    """On the driver: its loggers take over what rank 0's learned (same loggers, same order)."""
    for logger, state in zip(trainer.loggers, states):
        lightning.load_state_for_driver(logger, state)


def output_directories(trainer: pl.Trainer) -> list[str]:
    """On the driver: where rank 0's loggers keep files besides their log directories (MLflow's local
    store, Comet's offline directory), so the driver lets them land there."""
    found = []
    for logger in trainer.loggers:
        if isinstance(logger, MLFlowLogger):
            found.append(mlflow_store.local_store(lightning.mlflow_tracking_uri(logger)))
        elif isinstance(logger, CometLogger):
            found.append(getattr(lightning.comet_config(logger), "offline_directory", None))
    return [d for d in found if d]


def arriving_files(trainer: pl.Trainer, arriving: dict[str, bytes]) -> dict[str, bytes]:
    """On the driver: rank 0's staged files, a W&B run directory the driver already has renamed."""
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            arriving = wandb_run.arriving_files(logger, arriving)
    return arriving
