"""What a call sends to its workers: the Trainer, module and arguments, and the ``ckpt_path`` file.

The payload is put into Ray's object store once and every worker reads the same object. When it
cannot be pickled, the error names the deepest attribute that cannot (a lock, a client, an open
file) instead of pickle's bare message.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray
from pytorch_lightning.callbacks import ModelCheckpoint

from ray_lightning.runtime import CheckpointFile

if TYPE_CHECKING:
    import pytorch_lightning as pl


def checkpoint_argument(function: Callable, args: tuple, kwargs: dict, trainer: pl.Trainer | None) -> str | None:
    """The checkpoint file on this machine that ``fit``/``validate``/... were given, if any.

    ``"best"``/``"last"`` name the checkpoint callback's file, which is on this machine (copied
    back from rank 0's node), not necessarily on the workers' machines.
    """
    try:
        path = inspect.signature(function).bind_partial(*args, **kwargs).arguments.get("ckpt_path")
    except (TypeError, ValueError):
        return None
    callback = trainer.checkpoint_callback if trainer is not None else None
    if path in ("best", "last") and isinstance(callback, ModelCheckpoint):
        path = callback.best_model_path if path == "best" else callback.last_model_path
    if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
        return os.path.abspath(path)
    return None  # None, a remote URL, "best" without a file...: resolved by Lightning in the workers


def put_payload(trainer: pl.Trainer | None, function: Callable, args: tuple, kwargs: dict) -> ray.ObjectRef:
    """Serialize the Trainer, module and arguments once; every worker reads the same object."""
    try:
        return ray.put((trainer, function, args, kwargs))
    except Exception as error:
        culprit = _find_unserializable(trainer, args, kwargs)
        raise TypeError(
            f"ray_lightning could not send the training job to the Ray workers: {culprit or error}. "
            "Everything reachable from the LightningModule, DataModule, callbacks and loggers must be picklable; "
            "create such objects (locks, open files, clients) in `setup()` instead of `__init__()`."
        ) from error


def _find_unserializable(trainer: pl.Trainer | None, args: tuple, kwargs: dict) -> str | None:
    candidates: list[tuple[str, Any]] = []
    if trainer is not None and trainer.lightning_module is not None:
        candidates.append((type(trainer.lightning_module).__name__, trainer.lightning_module))
    candidates += [(f"argument {i}", a) for i, a in enumerate(args) if a is not None]
    candidates += [(f"argument {k!r}", v) for k, v in kwargs.items() if v is not None]
    if trainer is not None:
        candidates += [(type(cb).__name__, cb) for cb in trainer.callbacks]
        candidates += [(type(lg).__name__, lg) for lg in trainer.loggers]
    for label, obj in candidates:
        found = _deepest_unpicklable(obj, label, depth=0)
        if found:
            return found
    return None


_MODULE_CONTAINERS = ("_modules", "_parameters", "_buffers")


def _deepest_unpicklable(obj: Any, path: str, depth: int) -> str | None:
    """The most specific attribute path under ``obj`` that cloudpickle refuses, or None."""
    from ray import cloudpickle

    try:
        cloudpickle.dumps(obj)
        return None
    except Exception as error:  # noqa: BLE001 - any pickling failure is what we look for
        reason = f"{type(error).__name__}: {error}"
    children: list[tuple[str, Any]] = []
    if depth < 6:
        if isinstance(obj, dict):
            children = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set)):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif hasattr(obj, "__dict__"):
            for name, value in vars(obj).items():
                if name in _MODULE_CONTAINERS and isinstance(value, dict):
                    children += [(f"{path}.{k}", v) for k, v in value.items()]
                else:
                    children.append((f"{path}.{name}", value))
    for child_path, child in children:
        found = _deepest_unpicklable(child, child_path, depth + 1)
        if found:
            return found
    return f"{path} cannot be pickled ({reason})"


def checkpoint_files(
    path: str | None, local: bool, remote: bool
) -> tuple[CheckpointFile | None, CheckpointFile | None]:
    """The ``ckpt_path`` file for workers on the driver's machine (read in place) and on others (sent).

    Workers on other machines may not see the driver's file: it goes once through the object
    store (only when some worker is ``remote``) and each of them writes it locally.
    """
    if path is None:
        return None, None
    shipped = None
    if remote:
        with open(path, "rb") as f:
            shipped = CheckpointFile(path, ray.put(f.read()))
    return (CheckpointFile(path) if local else None), shipped


def with_checkpoint_path(function: Callable, args: tuple, kwargs: dict, path: str) -> tuple[tuple, dict]:
    """In a worker: ``args``/``kwargs`` of ``function`` with its ``ckpt_path`` argument replaced by ``path``."""
    bound = inspect.signature(function).bind_partial(*args, **kwargs)
    bound.arguments["ckpt_path"] = path
    return bound.args, bound.kwargs
