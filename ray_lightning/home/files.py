"""Files rank 0 writes (checkpoints, CSV/TensorBoard logs) end up on the driver's machine.

When rank 0 runs on another machine than the process that called ``fit`` (another node, or any
node when the driver is a Ray Client), the paths the driver chose may not exist or be writable
there (``/Users/alice/project`` on a Linux node). So rank 0 writes everything under a staging
directory instead (``<tmp>/<name the launcher chose>``): each local absolute path ``P`` the
Trainer would write under becomes ``<staging>/P``. When the call ends, every file in the staging
directory is sent back with the results and written at its original path on the driver; if it
fails, the launcher fetches them from rank 0's node (:func:`fetch_after_failure`), so a crash
loses no checkpoint. The checkpoint callbacks' state, in the ``.ckpt`` files and sent back, holds
the driver's paths.

The directory attributes rewritten here are Lightning's (:func:`ray_lightning._lightning.directory_holders`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from pytorch_lightning.callbacks import ModelCheckpoint

from ray_lightning import _lightning

if TYPE_CHECKING:
    import pytorch_lightning as pl


@dataclass(frozen=True)
class StagingArea:
    """Where rank 0, off the driver's machine, writes its files during a call: directory ``name`` on ``node_id``."""

    node_id: str
    name: str

    @classmethod
    def new(cls, node_id: str) -> StagingArea:
        return cls(node_id, f"ray_lightning-staging-{uuid.uuid4().hex[:12]}")


def _map_paths(trainer: pl.Trainer, mapping: Callable[[str], str]) -> None:
    for holder, attributes in _lightning.directory_holders(trainer):
        for name in attributes:
            value = getattr(holder, name, None)
            if isinstance(value, (str, os.PathLike)) and _lightning.is_local_file_protocol(value) and os.fspath(value):
                setattr(holder, name, mapping(os.fspath(value)))
        if isinstance(holder, ModelCheckpoint):
            holder.best_k_models = {mapping(str(k)): v for k, v in holder.best_k_models.items()}


def make_absolute(trainer: pl.Trainer) -> None:
    """On the driver, before launching: resolve relative directories against the driver's working directory.

    Workers elsewhere have another working directory; the driver's meaning of ``"logs/"`` wins.
    """
    _map_paths(trainer, lambda p: os.path.abspath(os.path.expanduser(p)))


def staging_dir(name: str) -> str:
    """The staging directory called ``name`` on this node."""
    return os.path.join(tempfile.gettempdir(), name)


def stage(trainer: pl.Trainer, staging: str) -> None:
    """In rank 0 off the driver's machine: write under ``staging`` instead of the driver's paths."""
    os.makedirs(staging, exist_ok=True)
    _map_paths(trainer, lambda p: to_staged(p, staging) if os.path.isabs(p) else p)
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint):
            _translate_state(callback, staging)


def _translate_state(callback: ModelCheckpoint, staging: str) -> None:
    """The callback's state speaks of the driver's paths: in checkpoints, on resume, sent back."""
    state_dict, load_state_dict = callback.state_dict, callback.load_state_dict

    def driver_state() -> dict[str, Any]:
        return from_staged(state_dict(), staging)

    def load_driver_state(state: dict[str, Any]) -> None:
        load_state_dict(_staged_value(state, staging))

    callback.state_dict = driver_state  # type: ignore[method-assign]
    callback.load_state_dict = load_driver_state  # type: ignore[method-assign]


def to_staged(path: str, staging: str) -> str:
    return os.path.join(staging, os.path.splitdrive(path)[1].lstrip("/\\"))


def _map_strings(value: Any, mapping: Callable[[str], str]) -> Any:
    """``value`` with ``mapping`` applied to every string in it, dict keys and nested containers included."""
    if isinstance(value, str):
        return mapping(value)
    if isinstance(value, dict):
        return {_map_strings(k, mapping): _map_strings(v, mapping) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_map_strings(v, mapping) for v in value)
    return value


def from_staged(value: Any, staging: str) -> Any:
    """``value`` (a path, or dicts/lists/tuples holding paths) with staged paths mapped back to the driver's."""
    prefix = staging + os.sep
    return _map_strings(value, lambda s: s[len(staging) :] if s.startswith(prefix) else s)


def _staged_value(value: Any, staging: str) -> Any:
    """The inverse of :func:`from_staged`: absolute paths in ``value`` moved under ``staging``."""
    return _map_strings(value, lambda s: to_staged(s, staging) if os.path.isabs(s) else s)


def collect(staging: str) -> dict[str, bytes]:
    """Every file written under ``staging``, keyed by its path on the driver.

    Symbolic links are left out: loggers link to files of their own (W&B's ``debug.log``, ``latest-run``,
    a log under the home directory), and the files they point to either come back themselves or
    are none of the driver's business.
    """
    files = {}
    for directory, _, names in os.walk(staging):
        for name in names:
            path = os.path.join(directory, name)
            if os.path.islink(path):
                continue
            with open(path, "rb") as f:
                files[from_staged(path, staging)] = f.read()
    return files


def collect_and_remove(name: str) -> dict[str, bytes]:
    """On rank 0's node: the files of the staging directory ``name``, which is then removed."""
    staging = staging_dir(name)
    files = collect(staging)
    shutil.rmtree(staging, ignore_errors=True)
    return files


def fetch_after_failure(area: StagingArea, timeout_s: float) -> list[str]:
    """After a failed call: bring what rank 0 staged in ``area`` to the driver; returns the paths written.

    Runs as a 0-CPU task on that node, so it needs none of the resources the workers held.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(collect_and_remove)
    on_node = NodeAffinitySchedulingStrategy(area.node_id, soft=False)
    files = ray.get(task.options(scheduling_strategy=on_node).remote(area.name), timeout=timeout_s)
    write(files)
    return sorted(files)


def write(files: dict[str, bytes]) -> None:
    """On the driver: write the files rank 0 sent back at their paths.

    A symbolic link at such a path is replaced, never written through (it may point at another of
    the driver's files, e.g. the log of an earlier W&B run).
    """
    for path, data in files.items():
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.islink(path):
            os.unlink(path)
        with open(path, "wb") as f:
            f.write(data)
