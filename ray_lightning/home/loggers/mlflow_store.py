"""``MLFlowLogger`` with a local store (``file:`` URI or a path): rank 0 logs into the driver's run.

The driver creates the experiment and the run (``logger.version``), as Lightning's launchers do,
and rank 0 writes into that run. Servers (``http:``, ``databricks``...) need nothing more; a local
store does:

* Driver (:func:`make_absolute`, :func:`ship`): the store's path is made absolute (workers have
  another working directory), and the run's files (its ``meta.yaml``, params, tags, metric
  histories; not its artifacts) and the experiments' ``meta.yaml`` go into the object store, read
  by rank 0 only when it runs off the driver's machine.
* Rank 0 off the driver's machine (:func:`enter`, :func:`leave`): writes them under its staging
  directory and logs there, artifacts included (the run's ``artifact_uri`` points there during the
  call and back at the driver's path after); the whole run comes home with rank 0's other files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import ray

from ray_lightning._lightning import loggers as lightning
from ray_lightning.home import files

# The attribute of the worker's copy of the logger that holds the run's files (an ObjectRef).
_CARRIED = "ray_lightning_store_files"
_DEFAULT_EXPERIMENT = "0"


def local_store(uri: str | None) -> str | None:
    """The directory of a local file store ``uri`` (``file:./mlruns``, ``file:///abs``, ``./mlruns``); else None."""
    if not uri:
        return None
    parsed = urlparse(uri)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        return parsed.path or None
    if parsed.scheme == "":
        return uri
    return None


def _with_path(uri: str, path: str) -> str:
    """``uri`` naming the local directory ``path`` instead, in the same form (with or without ``file:``)."""
    return f"file:{path}" if urlparse(uri).scheme == "file" else path


def make_absolute(logger: Any) -> None:
    """On the driver, before the run is created: the store's path is the driver's, absolute."""
    uri = lightning.mlflow_tracking_uri(logger)
    store = local_store(uri)
    if store is None:
        return
    absolute = os.path.abspath(os.path.expanduser(store))
    if absolute != store:
        lightning.set_mlflow_tracking_uri(logger, _with_path(uri, absolute))


@dataclass
class RunFiles:
    """The run's folders and files on the driver, which a rank 0 elsewhere recreates under its staging directory."""

    directories: list[str] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)

    def write_under(self, staging: str) -> None:
        for directory in self.directories:
            os.makedirs(files.to_staged(directory, staging), exist_ok=True)
        for path, data in self.files.items():
            staged = files.to_staged(path, staging)
            os.makedirs(os.path.dirname(staged), exist_ok=True)
            with open(staged, "wb") as f:
                f.write(data)


def ship(logger: Any) -> None:
    """On the driver, after the run exists: its files go along, for a rank 0 on another machine."""
    store = local_store(lightning.mlflow_tracking_uri(logger))
    if store is None:
        return
    run_files = _run_files(store, logger.experiment_id, logger.run_id)
    lightning.ship(logger, {_CARRIED: ray.put(run_files)})


def _run_files(store: str, experiment_id: str, run_id: str) -> RunFiles:
    carried = RunFiles()
    for experiment in (_DEFAULT_EXPERIMENT, experiment_id):
        meta = os.path.join(store, experiment, "meta.yaml")
        if os.path.isfile(meta):
            carried.files[meta] = _read(meta)
    run = os.path.join(store, experiment_id, run_id)
    for directory, subdirectories, names in os.walk(run):
        carried.directories.append(directory)  # MLflow finds a run by its (maybe empty) folders
        if directory == run and "artifacts" in subdirectories:
            subdirectories.remove("artifacts")  # they stay here; rank 0 only adds to them
            carried.directories.append(os.path.join(run, "artifacts"))
        for name in names:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                carried.files[path] = _read(path)
    return carried


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@dataclass
class StagedRun:
    """Rank 0's staged copy of the run: its ``meta.yaml`` and the ``artifact_uri`` line it has on the driver."""

    meta: str
    driver_line: str
    run_id: str


def enter(logger: Any, staging: str | None, rank_zero: bool) -> StagedRun | None:
    """In a worker, before the Trainer function: rank 0 off the driver's machine logs into a staged copy."""
    carried = vars(logger).pop(_CARRIED, None)
    uri = lightning.mlflow_tracking_uri(logger)
    store = local_store(uri)
    if staging is None or not rank_zero or carried is None or store is None:
        return None
    ray.get(carried).write_under(staging)
    lightning.set_mlflow_tracking_uri(logger, _with_path(uri, files.to_staged(store, staging)))
    meta = files.to_staged(os.path.join(store, logger.experiment_id, logger.run_id, "meta.yaml"), staging)
    return _stage_artifacts(meta, staging, logger.run_id)


def _stage_artifacts(meta: str, staging: str, run_id: str) -> StagedRun | None:
    """Point the staged run's ``artifact_uri`` (a local directory of the driver's) under ``staging``."""
    driver_line = _artifact_uri_line(meta) if os.path.isfile(meta) else None
    if driver_line is None:
        return None
    artifact_uri = driver_line.split(":", 1)[1].strip()
    artifacts = local_store(artifact_uri)
    if artifacts is None or not os.path.isabs(artifacts):
        return None  # a server or bucket: rank 0 uploads there
    _set_artifact_uri_line(meta, f"artifact_uri: {_with_path(artifact_uri, files.to_staged(artifacts, staging))}\n")
    lightning.forget_mlflow_artifact_repository(run_id)
    return StagedRun(meta, driver_line, run_id)


def leave(staged: StagedRun) -> None:
    """In rank 0, after the Trainer function: the staged run's ``artifact_uri`` is the driver's again."""
    if os.path.isfile(staged.meta):
        _set_artifact_uri_line(staged.meta, staged.driver_line)
    lightning.forget_mlflow_artifact_repository(staged.run_id)


def _artifact_uri_line(meta: str) -> str | None:
    with open(meta, encoding="utf-8") as f:
        return next((line for line in f if line.startswith("artifact_uri:")), None)


def _set_artifact_uri_line(meta: str, new: str) -> None:
    with open(meta, encoding="utf-8") as f:
        lines = [new if line.startswith("artifact_uri:") else line for line in f]
    with open(meta, "w", encoding="utf-8") as f:
        f.writelines(lines)
