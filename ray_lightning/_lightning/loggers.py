"""Private attributes of Lightning's W&B, MLflow and Comet loggers, under names of our own.

Each is used because no public API does the job (what is done with them:
:mod:`ray_lightning.home.loggers`):

* ``WandbLogger._experiment``, ``CometLogger._experiment``: the run the logger holds, if any; the
  driver hands it over to rank 0 and rank 0 finishes its own (``logger.experiment`` would start one).
* ``WandbLogger._wandb_init``, ``_id``: the arguments of ``wandb.init`` and the run id
  (``logger.version`` only reads the id).
* ``WandbLogger.__getstate__`` starts a run in the process that pickles the logger: the driver
  ships the logger's state without it (:func:`ship`).
* ``_logged_model_time`` (W&B, MLflow) and ``WandbLogger._checkpoint_name``: which checkpoints rank 0
  logged as artifacts; the driver's logger learns them, so the next ``fit`` does not log them again.
* ``MLFlowLogger._tracking_uri``, ``_mlflow_client``: where the run is stored (``save_dir`` only reads it).
* ``CometLogger._comet_config``: where an offline experiment is archived (``save_dir`` only reads it).
* ``CSVLogger.experiment.metrics_keys`` and ``metrics_file_path`` (of Lightning's private
  ``_ExperimentWriter``): a CSV log a restarted rank 0 continues (:func:`continue_csv_log`).
* MLflow's own ``mlflow.tracking._tracking_service.utils._artifact_repos_cache``: the artifact
  location MLflow keeps per run and process, which a reused worker must forget after a call whose
  rank 0 logged into a staging directory (:func:`forget_mlflow_artifact_repository`). It is
  MLflow's private, not Lightning's, but it is here, with the ``MLFlowLogger``'s, rather than in a
  fence of its own: it is one name, it serves the same code (``home/loggers/mlflow_store.py``) and
  needs the same optional package, which the ``needs`` of :data:`PRIVATE_NAMES` already handles.

Every one is in :data:`PRIVATE_NAMES` (via :mod:`.names`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable
from typing import Any

from ray_lightning.namespaces import Namespace

# What rank 0's logger knows after a call that the driver's must know for the next one.
STATE_FOR_DRIVER = ("_logged_model_time", "_checkpoint_name")
WANDB_ATTRIBUTES = ("_experiment", "_wandb_init", "_id", "_logged_model_time", "_checkpoint_name")
MLFLOW_ATTRIBUTES = ("_tracking_uri", "_mlflow_client", "_logged_model_time")
COMET_ATTRIBUTES = ("_experiment", "_comet_config")
CSV_ATTRIBUTES = ("experiment.metrics_keys", "experiment.metrics_file_path")
# MLflow's (not Lightning's): (module, attribute) of each run's artifact repository, per process.
MLFLOW_ARTIFACT_CACHE = ("mlflow.tracking._tracking_service.utils", "_artifact_repos_cache")


def continue_csv_log(logger: Any, before_step: int | None) -> None:
    """Keep the rows of the CSV log ``logger`` finds (written before a restart) and append to them.

    Lightning's CSV writer, created in a new process, deletes the metrics file it finds, which
    would leave a restarted fit's log with the rows after the restart only. Rows of steps from
    ``before_step`` on are dropped: the restarted fit trains and logs those steps again.
    """
    import csv

    path = os.path.join(logger.log_dir, "metrics.csv")
    if not os.path.isfile(path):
        return
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        keys, rows = list(reader.fieldnames or []), list(reader)
    if before_step is not None:
        rows = [row for row in rows if not row.get("step", "").isdigit() or int(row["step"]) < before_step]
    writer = logger.experiment  # created now: deletes the file
    with open(writer.metrics_file_path, "w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=keys)
        out.writeheader()
        out.writerows(rows)
    writer.metrics_keys = keys


def live_run(logger: Any) -> Any:
    """The run (W&B) or experiment (Comet) ``logger`` holds, without starting one; None if none."""
    return vars(logger).get("_experiment")


def forget_run(logger: Any) -> None:
    logger._experiment = None


def wandb_init_arguments(logger: Any) -> dict[str, Any]:
    """The keyword arguments the W&B logger passes to ``wandb.init`` (the logger's own dict: changes stick)."""
    return logger._wandb_init


def wandb_run_id(logger: Any) -> str | None:
    return logger._id


def set_wandb_run_id(logger: Any, run_id: str) -> None:
    logger._id = run_id
    logger._wandb_init["id"] = run_id


def state_for_driver(logger: Any) -> dict[str, Any]:
    """What of ``logger`` the driver's copy takes over after a call (:data:`STATE_FOR_DRIVER`)."""
    return {name: getattr(logger, name) for name in STATE_FOR_DRIVER if hasattr(logger, name)}


def load_state_for_driver(logger: Any, state: dict[str, Any]) -> None:
    for name, value in state.items():
        if name in STATE_FOR_DRIVER and hasattr(logger, name):
            setattr(logger, name, value)


def mlflow_tracking_uri(logger: Any) -> str:
    return logger._tracking_uri


def set_mlflow_tracking_uri(logger: Any, uri: str) -> None:
    """Point ``logger`` (whose run already exists) at the store ``uri``."""
    from mlflow.tracking import MlflowClient

    logger._tracking_uri = uri
    logger._mlflow_client = MlflowClient(uri)


def forget_mlflow_artifact_repository(run_id: str) -> None:
    """Make MLflow look up the run's artifact location again on its next use in this process.

    MLflow keeps each run's artifact location per process: a call's staging directory is gone after
    the call, and a reused worker must not write the next call's artifacts there.
    """
    with contextlib.suppress(ImportError, AttributeError):
        cache = getattr(importlib.import_module(MLFLOW_ARTIFACT_CACHE[0]), MLFLOW_ARTIFACT_CACHE[1])
        cache.pop(run_id, None)


def comet_config(logger: Any) -> Any:
    """The ``comet_ml.ExperimentConfig`` the Comet logger starts its experiments with."""
    return logger._comet_config


def ship(logger: Any, extra: dict[str, Any] | None = None) -> None:
    """From now on ``logger`` pickles as its attributes, ``extra`` added and no live run.

    Plain attribute state, as every Lightning logger but W&B's pickles; ``WandbLogger.__getstate__``
    would call ``wandb.init`` in this process. The hook is on this one object (pickle, cloudpickle
    and ``copy`` look ``__reduce_ex__`` up on the instance); calling ``ship`` again replaces ``extra``.
    """
    logger.__reduce_ex__ = _Reduce(logger, dict(extra or {}))


class _Reduce:
    """``logger.__reduce_ex__``: rebuild the logger from its attributes, without its run."""

    def __init__(self, logger: Any, extra: dict[str, Any]) -> None:
        self.logger = logger
        self.extra = extra

    def __call__(self, protocol: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        state = {k: v for k, v in vars(self.logger).items() if k != "__reduce_ex__"}
        if "_experiment" in state:
            state["_experiment"] = None
        state.update(self.extra)
        return _rebuild, (type(self.logger), state)


def _rebuild(cls: type, state: dict[str, Any]) -> Any:
    logger = cls.__new__(cls)
    logger.__dict__.update(state)
    return logger


def _make(ns: Namespace, kind: str, **kwargs: Any) -> Callable[[], Any]:
    return lambda: ns.pl(f"loggers.{kind}")(**kwargs)


def logger_owners(ns: Namespace) -> tuple[tuple[str, str | None, tuple[str, ...], Callable[[], Any]], ...]:
    """``(where, the package it needs, private attributes, a logger to look on)`` for each logger of ``ns``."""
    where = f"{ns.trainer_package}.loggers"
    return (
        (f"{where}.WandbLogger", "wandb", WANDB_ATTRIBUTES, _make(ns, "WandbLogger", save_dir=os.devnull)),
        # A server URI: the client connects to nothing until used (a file store would be created).
        (
            f"{where}.MLFlowLogger",
            "mlflow",
            MLFLOW_ATTRIBUTES,
            _make(ns, "MLFlowLogger", tracking_uri="http://127.0.0.1:9"),
        ),
        # A disabled experiment: no key, no network, no files.
        (f"{where}.CometLogger", "comet_ml", COMET_ATTRIBUTES, _make(ns, "CometLogger", online=False)),
        # Its experiment makes a version directory: in a directory of its own.
        (f"{where}.CSVLogger", None, CSV_ATTRIBUTES, _csv_logger(ns)),
    )


def third_party_owners() -> tuple[tuple[str, str | None, tuple[str, ...], Callable[[], Any]], ...]:
    """As :func:`logger_owners`, for the private names of the loggers' own packages (whatever the namespace)."""
    module, name = MLFLOW_ARTIFACT_CACHE
    return ((module, "mlflow", (name,), lambda: importlib.import_module(module)),)


def _csv_logger(ns: Namespace) -> Callable[[], Any]:
    import tempfile

    return lambda: ns.pl("loggers.CSVLogger")(save_dir=tempfile.mkdtemp(prefix="ray_lightning-names-"))
