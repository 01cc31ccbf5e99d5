"""What a call sends to its workers: the Trainer, module and arguments, and the ``ckpt_path`` file.

The payload is put into Ray's object store once and every worker reads the same object. When it
cannot be pickled, the error names the deepest attribute that cannot (a lock, a client, an open
file) instead of pickle's bare message.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from ray_lightning import _lightning, namespaces
from ray_lightning.launch.session import driver_node_id
from ray_lightning.launch.weights_out import weights_aside
from ray_lightning.runtime import CheckpointFile

if TYPE_CHECKING:
    import pytorch_lightning as pl

# How long the nodes may take to say whether a ckpt_path missing here exists on them.
_PROBE_TIMEOUT_S = 30.0


def given_checkpoint(function: Callable, args: tuple, kwargs: dict) -> Any:
    """The ``ckpt_path`` argument of the call, as given (None when it has none)."""
    return _given_checkpoint(function, args, kwargs)


def _given_checkpoint(function: Callable, args: tuple, kwargs: dict) -> Any:
    try:
        return inspect.signature(function).bind_partial(*args, **kwargs).arguments.get("ckpt_path")
    except (TypeError, ValueError):
        return None


def enter_driver_hooks(
    function: Callable, args: tuple, kwargs: dict, trainer: pl.Trainer | None, stack: contextlib.ExitStack
) -> tuple[tuple, dict]:
    """Callbacks that take part on the driver, around the whole call; a ``fit`` given no ``ckpt_path`` resumes
    from the checkpoint one of them names.

    A callback takes part with an ``around_driver_call(trainer)`` method: a context manager entered here, on
    the driver, before anything starts, and left when ``stack`` closes, after the workers' results are home
    (it may raise then: a Tune trial that Tune stopped ends). It yields a checkpoint file's path, or None
    (``ray_lightning.tune``'s callback yields the checkpoint Tune restored the trial with).
    """
    if trainer is None:
        return args, kwargs
    resume = trainer.state.fn == namespaces.FITTING and not _given_checkpoint(function, args, kwargs)
    for callback in trainer.callbacks:
        around = getattr(callback, "around_driver_call", None)
        if around is None:
            continue
        path = stack.enter_context(around(trainer))
        if path is not None and resume:
            args, kwargs = with_checkpoint_path(function, args, kwargs, path)
            resume = False
    return args, kwargs


def read_in_place(trainer: pl.Trainer | None, path: str | None) -> bool:
    """Whether ``path`` is a checkpoint a driver hook named as one every worker reads where it is (a Tune trial's,
    in Tune's storage, which Tune requires every node to reach): it is never sent through the object store."""
    if trainer is None or path is None:
        return False
    return any(getattr(callback, "checkpoint_read_in_place", None) == path for callback in trainer.callbacks)


def _names_a_checkpoint(path: str) -> bool:
    """Lightning's own ``ckpt_path`` names, resolved by the Trainer: best, last, hpc, registry[:...]."""
    lowered = path.lower()
    return path in ("best", "last", "hpc") or lowered == "registry" or lowered.startswith("registry:")


def check_checkpoint_exists(function: Callable, args: tuple, kwargs: dict) -> None:
    """Refuse, before any worker starts, a ``ckpt_path`` file that exists nowhere.

    Remote URLs (``s3://...``) and Lightning's named checkpoints are left to Lightning. A path
    missing here may still be on a node of the cluster (its local disk, a mount the driver lacks):
    a 0-CPU task on each node looks there; only when no node has it is the path refused.
    """
    path = _given_checkpoint(function, args, kwargs)
    if not isinstance(path, (str, os.PathLike)):
        return
    path = os.fspath(path)
    if _names_a_checkpoint(path) or not _lightning.is_local_file_protocol(path) or os.path.exists(path):
        return
    if _exists_on_a_node(path):
        return
    raise FileNotFoundError(
        f"ckpt_path={path!r} exists neither on this machine nor on any node of the Ray cluster. Pass the path of an "
        "existing checkpoint, a remote URL (s3://...), or 'best'/'last' for the checkpoint callback's."
    )


def _exists_on_a_node(path: str) -> bool:
    """Whether ``path`` exists on some alive node other than this process's (True when that cannot be told)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = driver_node_id()
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != here]
    if not nodes:
        return False
    probe = ray.remote(num_cpus=0, max_retries=0)(os.path.exists)
    on = [NodeAffinitySchedulingStrategy(node, soft=False) for node in nodes]
    try:
        return any(ray.get([probe.options(scheduling_strategy=s).remote(path) for s in on], timeout=_PROBE_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - a node that cannot answer: let Lightning in the workers decide
        return True


def checkpoint_argument(function: Callable, args: tuple, kwargs: dict, trainer: pl.Trainer | None) -> str | None:
    """The checkpoint file on this machine that ``fit``/``validate``/... were given, if any.

    ``"best"``/``"last"`` name the checkpoint callback's file, which is on this machine (copied
    back from rank 0's node), not necessarily on the workers' machines.
    """
    path = _given_checkpoint(function, args, kwargs)
    callback = trainer.checkpoint_callback if trainer is not None else None
    if path in ("best", "last") and isinstance(callback, namespaces.every("callbacks.ModelCheckpoint")):
        path = callback.best_model_path if path == "best" else callback.last_model_path
    if isinstance(path, (str, os.PathLike)) and os.path.exists(path):
        return os.path.abspath(path)  # a file, or a sharded checkpoint's directory
    return None  # None, a remote URL, "best" without a file...: resolved by Lightning in the workers


def prepare_arguments(trainer: pl.Trainer | None, args: tuple, kwargs: dict, resources: Any) -> list[Callable]:
    """On the driver, before the payload is made: every argument that prepares for the workers (a
    ``RayDataModule`` checks its datasets and starts their coordinators) does so; returns what ends each."""
    ends = []
    if trainer is None:
        return ends
    for value in (*args, *kwargs.values()):
        prepare = getattr(value, "ray_lightning_prepare", None)
        if callable(prepare):
            ends.append(prepare(trainer, resources))
    return ends


def put_payload(
    trainer: pl.Trainer | None, function: Callable, args: tuple, kwargs: dict, strategy: Any = None
) -> ray.ObjectRef:
    """Serialize the Trainer, module and arguments once; every worker reads the same object.

    ``strategy``: without a Trainer (Fabric's ``launch``), the strategy the workers attach, pickled with
    the arguments so that it is the very object the function's Fabric holds.
    The modules' big tensors travel beside the pickle, in chunks (:mod:`.weights_out`); the payload
    holds what :func:`~.weights_out.take_weights` needs to put them back in each worker.
    """
    modules = [trainer.lightning_module if trainer is not None else None, *args, *kwargs.values()]
    try:
        with weights_aside(modules) as aside:
            return ray.put((trainer, function, args, kwargs, aside, strategy))
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
    path: str | None, local: bool, remote: bool, in_storage: bool = False
) -> tuple[CheckpointFile | None, CheckpointFile | None]:
    """The ``ckpt_path`` file for workers on the driver's machine (read in place) and on others (sent).

    ``in_storage``: the path is in the run's storage (``storage_path``), which every worker reads itself.

    Workers on other machines may not see the driver's file: it goes once through the object
    store (only when some worker is ``remote``) and each of them writes it locally. A sharded
    checkpoint is a directory: all its files go (each rank may read any part of them when the number
    of ranks differs from the number that saved it).
    """
    if path is None:
        return None, None
    if in_storage:
        read_there = CheckpointFile(path)
        return (read_there if local else None), (read_there if remote else None)
    shipped = None
    if remote:
        shipped = CheckpointFile(path, ray.put(_read_checkpoint(path)))
    return (CheckpointFile(path) if local else None), shipped


def _read_checkpoint(path: str) -> bytes | dict[str, bytes]:
    """A file's bytes, or a directory's files by relative path."""
    if not os.path.isdir(path):
        with open(path, "rb") as f:
            return f.read()
    found = {}
    for directory, _, names in os.walk(path):
        for name in names:
            full = os.path.join(directory, name)
            with open(full, "rb") as f:
                found[os.path.relpath(full, path)] = f.read()
    return found


def with_checkpoint_path(function: Callable, args: tuple, kwargs: dict, path: str) -> tuple[tuple, dict]:
    """``args``/``kwargs`` of ``function`` with its ``ckpt_path`` argument replaced by ``path``."""
    bound = inspect.signature(function).bind_partial(*args, **kwargs)
    bound.arguments["ckpt_path"] = path
    return bound.args, bound.kwargs
