"""Private Lightning functions, classes and attributes, under names of our own.

Each is used because no public API does the job:

* ``_Launcher``: the base class Lightning's strategies expect from ``strategy.launcher``.
* ``_init_dist_connection``: Lightning's process-group setup (sets ``torch.distributed``'s env
  and logs), called with our own store so the group meets on rank 0's OS-chosen port.
* ``_MockOptimizer``: Lightning's stand-in when a module has no optimizer; Horovod must not wrap it.
* ``_is_local_file_protocol``: which directories are local files (remote URLs are left alone).
* ``Trainer._default_root_dir``, the loggers' ``_root_dir``/``_save_dir``: the directories rank 0
  writes into, which have no public setters (rank 0 off the driver's machine stages them).
* The private attributes of the W&B, MLflow and Comet loggers, and MLflow's own cache of artifact
  locations (:mod:`.loggers`).
* ``Trainer._checkpoint_connector.dump_checkpoint``: the checkpoint ``trainer.save_checkpoint``
  would write, as a dict, in rank 0 alone (``save_checkpoint`` is collective and writes a file):
  the recovery checkpoints of a fit that may restart its workers.
* The fit loop's progress counters and ``_batches_that_stepped`` (the step loggers are given):
  restored on the driver so ``current_epoch``/``global_step`` are rank 0's after ``fit``, and a
  second ``fit`` logs its metrics at the steps after the first's, as in Lightning.

:data:`PRIVATE_NAMES` lists every private name of this folder with where Lightning keeps it;
``tests/test_lightning_internals.py`` checks each and names any that moved. Every name is looked up
in the Lightning namespace in use (``pytorch_lightning`` or ``lightning.pytorch``,
:mod:`ray_lightning.namespaces`), and :data:`PRIVATE_NAMES` holds them for each installed one.
:class:`PrivateName`, the record of one, is shared with the Ray and torch fences
(:mod:`ray_lightning._torch.private`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ray_lightning import namespaces
from ray_lightning._lightning import fabric as fabric_names
from ray_lightning._lightning import sharded
from ray_lightning._lightning.loggers import logger_owners, third_party_owners
from ray_lightning._torch.private import PrivateName
from ray_lightning.namespaces import Namespace

if TYPE_CHECKING:
    import pytorch_lightning as pl

LAUNCHER = "strategies.launchers.launcher._Launcher"
INIT_DIST_CONNECTION = "utilities.distributed._init_dist_connection"  # fabric's
MOCK_OPTIMIZER = "core.optimizer._MockOptimizer"
IS_LOCAL_FILE_PROTOCOL = "utilities.cloud_io._is_local_file_protocol"  # fabric's
CONNECTOR = "trainer.connectors.accelerator_connector._AcceleratorConnector"


def launcher_bases() -> tuple[type, ...]:
    """The base class Lightning's strategies expect of ``strategy.launcher``, of every installed namespace."""
    return namespaces.every(LAUNCHER)


def init_dist_connection(ns: Namespace, *args: Any, **kwargs: Any) -> None:
    """Lightning's process-group setup, of the namespace the strategy belongs to."""
    ns.fabric(INIT_DIST_CONNECTION)(*args, **kwargs)


def is_local_file_protocol(path: Any) -> bool:
    return namespaces.primary().fabric(IS_LOCAL_FILE_PROTOCOL)(path)


# Where the Trainer, its loggers and checkpoint callbacks keep the directories they write into.
TRAINER_DIRECTORIES = ("_default_root_dir",)
LOGGER_DIRECTORIES = ("_root_dir", "_save_dir")  # CSVLogger, TensorBoardLogger (and their fabric bases)
LOGGER_FILESYSTEM = "_fs"  # the fsspec filesystem CSVLogger and TensorBoardLogger made for their directory
CHECKPOINT_PATHS = ("dirpath", "best_model_path", "last_model_path", "kth_best_model_path")  # public
# The fit loop's counters behind current_epoch and global_step: (name in the state, path from the fit loop).
FIT_PROGRESS = (
    ("epoch_progress", "epoch_progress"),
    ("epoch_loop.batch_progress", "epoch_loop.batch_progress"),
    ("automatic_optimization", "epoch_loop.automatic_optimization.optim_progress"),
    ("manual_optimization", "epoch_loop.manual_optimization.optim_step_progress"),
)
# Plain values of the fit loop: the step Lightning passes to `logger.log_metrics` (a counter of its own,
# not global_step: it is saved in checkpoints and must continue in the next fit).
FIT_COUNTERS = (("batches_that_stepped", "epoch_loop._batches_that_stepped"),)


CHECKPOINT_CONNECTOR = "_checkpoint_connector"


def dump_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """The full checkpoint (weights, optimizers, schedulers, loops, callbacks) ``trainer.save_checkpoint`` writes."""
    return getattr(trainer, CHECKPOINT_CONNECTOR).dump_checkpoint(weights_only=False)


def is_last_batch(trainer: pl.Trainer) -> bool:
    """Whether the training batch that just ended is its epoch's last."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def is_mock_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is Lightning's stand-in for a module that configured none."""
    return isinstance(optimizer, namespaces.every(MOCK_OPTIMIZER))


def directory_holders(trainer: pl.Trainer) -> Iterator[tuple[Any, tuple[str, ...]]]:
    """``(object, attribute names)`` for everything that holds a directory or file rank 0 writes to."""
    yield trainer, TRAINER_DIRECTORIES
    yield from logger_directory_holders(trainer.loggers)
    model_checkpoint = namespaces.every("callbacks.ModelCheckpoint")
    for callback in trainer.callbacks:
        if isinstance(callback, model_checkpoint):
            yield callback, CHECKPOINT_PATHS


def logger_directory_holders(loggers: Iterable[Any]) -> Iterator[tuple[Any, tuple[str, ...]]]:
    """``(logger, attribute names)`` of the directories loggers (the Trainer's or Fabric's) write under."""
    for logger in loggers:
        yield logger, LOGGER_DIRECTORIES


def use_filesystems_of_paths(trainer: pl.Trainer) -> None:
    """After the loggers' directories moved (to storage): each logger uses the filesystem of its new directory.

    CSVLogger and TensorBoardLogger pick their fsspec filesystem once, in ``__init__``, from the directory given.
    """
    use_filesystems_of_logger_paths(trainer.loggers)


def use_filesystems_of_logger_paths(loggers: Iterable[Any]) -> None:
    """After the loggers' (the Trainer's or Fabric's) directories moved: each uses the filesystem of its new one."""
    from fsspec.core import url_to_fs

    for logger in loggers:
        root = getattr(logger, "_root_dir", None)
        if isinstance(root, (str, os.PathLike)) and hasattr(logger, LOGGER_FILESYSTEM):
            setattr(logger, LOGGER_FILESYSTEM, url_to_fs(os.fspath(root))[0])


def output_directories(trainer: pl.Trainer) -> Iterator[str]:
    """The directories rank 0 writes under: ``default_root_dir``, the loggers' and the checkpoint callbacks'."""
    for holder, attributes in directory_holders(trainer):
        for name in attributes:
            if name in CHECKPOINT_PATHS and name != "dirpath":
                continue  # files in the directory, not directories
            value = getattr(holder, name, None)
            if isinstance(value, (str, os.PathLike)) and os.fspath(value):
                yield os.fspath(value)


def _progress(trainer: pl.Trainer, path: str) -> Any:
    obj: Any = trainer.fit_loop
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _owner_and_name(trainer: pl.Trainer, path: str) -> tuple[Any, str]:
    owner, _, name = path.rpartition(".")
    return _progress(trainer, owner), name


def fit_progress_state(trainer: pl.Trainer) -> dict[str, Any]:
    """The fit loop's progress counters, to be restored elsewhere with :func:`load_fit_progress`."""
    state = {key: _progress(trainer, path).state_dict() for key, path in FIT_PROGRESS}
    for key, path in FIT_COUNTERS:
        state[key] = getattr(*_owner_and_name(trainer, path))
    return state


def batches_processed(trainer: pl.Trainer) -> int:
    """Training batches of the current epoch whose step ran (the one in ``on_train_batch_end`` included)."""
    return int(_progress(trainer, "epoch_loop.batch_progress").current.processed)


def set_batches_done(trainer: pl.Trainer, done: int) -> None:
    """Restart the current epoch's batch count at ``done`` processed batches (a resumed epoch whose loader yields only
    the rest). Every counter moves by as much: a checkpoint of ``on_train_batch_end`` has ``completed`` one behind,
    which Lightning's restart makes up."""
    current = _progress(trainer, "epoch_loop.batch_progress").current
    shift = done - current.processed
    for name in ("ready", "started", "processed", "completed"):
        setattr(current, name, getattr(current, name) + shift)


def settle_failed_batch(trainer: pl.Trainer) -> None:
    """In a fit that failed inside a training batch: its batch counters as right after the last batch whose optimizer
    step completed (``accumulate_grad_batches``: the batches since then lose their gradients). Every counter equal,
    so Lightning resumes at the next batch without counting the loggers' step again (2.6's ``RESTARTED_ON_LAST``; no
    such adjustment before 2.5). Left alone when it failed after the step, in ``on_train_batch_end``: that is
    Lightning's own ``on_train_batch_end`` checkpoint, which its restart already counts."""
    progress = _progress(trainer, "epoch_loop.batch_progress")
    current, total = progress.current, progress.total
    done = current.processed - current.processed % max(1, trainer.accumulate_grad_batches)
    if done == current.processed == current.started == current.ready == current.completed + 1:
        return
    back = current.processed - done
    for counter, value in ((current, done), (total, total.processed - back)):
        for name in ("ready", "started", "processed", "completed"):
            setattr(counter, name, value)


def load_fit_progress(trainer: pl.Trainer, state: dict[str, Any]) -> None:
    for key, path in FIT_PROGRESS:
        _progress(trainer, path).load_state_dict(state[key])
    for key, path in FIT_COUNTERS:
        if key in state:
            setattr(*_owner_and_name(trainer, path), state[key])


def _module(ns: Namespace, path: str, *, fabric: bool = False) -> Callable[[], Any]:
    package = ns.fabric_package if fabric else ns.trainer_package
    return lambda: importlib.import_module(f"{package}.{path}")


def _trainer(ns: Namespace) -> Callable[[], Any]:
    return lambda: ns.pl("Trainer")(logger=False, enable_checkpointing=False, enable_progress_bar=False)


def _ddp_strategy(ns: Namespace) -> Callable[[], Any]:
    return lambda: ns.pl("strategies.DDPStrategy")()


def _logger(ns: Namespace, kind: str) -> Callable[[], Any]:
    return lambda: ns.pl(f"loggers.{kind}")(os.devnull)


def _private_names(ns: Namespace) -> Iterator[PrivateName]:
    pl_, fabric = ns.trainer_package, ns.fabric_package
    for path, is_fabric in ((LAUNCHER, False), (INIT_DIST_CONNECTION, True), (MOCK_OPTIMIZER, False),
                            (IS_LOCAL_FILE_PROTOCOL, True), (CONNECTOR, False)):  # fmt: skip
        module, _, name = path.rpartition(".")
        yield PrivateName(f"{fabric if is_fabric else pl_}.{module}", name, _module(ns, module, fabric=is_fabric))
    for method in ("_check_config_and_set_final_flags", "_choose_strategy", "_init_strategy"):
        yield PrivateName(f"{pl_}.{CONNECTOR}", method, lambda: ns.pl(CONNECTOR))
    trainer = _trainer(ns)
    connector = f"a {pl_} Trainer's _AcceleratorConnector"
    yield PrivateName(connector, "_strategy_flag", lambda: trainer()._accelerator_connector)
    yield PrivateName(f"{pl_}.Trainer", "_default_root_dir", trainer)
    yield PrivateName(f"{pl_}.Trainer", f"{CHECKPOINT_CONNECTOR}.dump_checkpoint", trainer)
    yield PrivateName(f"{pl_}.loggers.CSVLogger", "_root_dir", _logger(ns, "CSVLogger"))
    yield PrivateName(f"{pl_}.loggers.CSVLogger", "_save_dir", _logger(ns, "CSVLogger"))
    yield PrivateName(f"{pl_}.loggers.TensorBoardLogger", "_root_dir", _logger(ns, "TensorBoardLogger"))
    for kind in ("CSVLogger", "TensorBoardLogger"):
        for name in ("_root_dir", LOGGER_FILESYSTEM):
            yield PrivateName(f"{fabric}.loggers.{kind}", name, lambda k=kind: ns.fabric(f"loggers.{k}")(os.devnull))
    for kind in ("CSVLogger", "TensorBoardLogger"):
        yield PrivateName(f"{pl_}.loggers.{kind}", LOGGER_FILESYSTEM, _logger(ns, kind))
    for name in ("_accelerator", "_launcher", "_lightning_optimizers", "_configure_launcher"):
        yield PrivateName(f"{pl_}.strategies.Strategy", name, _ddp_strategy(ns))
    for name in ("_timeout", "_process_group_backend", "_get_process_group_backend"):
        yield PrivateName(f"{pl_}.strategies.DDPStrategy", name, _ddp_strategy(ns))
    for _, path in FIT_PROGRESS + FIT_COUNTERS:
        yield PrivateName(f"{pl_}.Trainer.fit_loop", path, lambda: trainer().fit_loop)
    yield PrivateName(f"{pl_}.Trainer.fit_loop", "epoch_loop.batch_progress.is_last_batch", lambda: trainer().fit_loop)
    for path in (sharded.LOAD_CHECKPOINT, sharded.REKEY, sharded.METADATA_FILENAME, sharded.MATERIALIZE,
                 sharded.OPTIMIZERS_TO_DEVICE):  # fmt: skip
        module, _, name = path.rpartition(".")
        yield PrivateName(f"{fabric}.{module}", name, _module(ns, module, fabric=True))
    model_parallel = f"{pl_}.strategies.ModelParallelStrategy"
    for name in (sharded.MESH, sharded.SAVE_DISTRIBUTED):
        yield PrivateName(model_parallel, name, lambda: ns.pl("strategies.ModelParallelStrategy")())
    for path in sharded.EVALUATION_LOOPS:
        yield PrivateName(f"{pl_}.Trainer", f"{path}.{sharded.INFERENCE_MODE}", trainer)
    yield PrivateName(f"{pl_}.LightningModule", sharded.MESH, lambda: ns.pl("LightningModule")())
    fsdp = f"{pl_}.strategies.FSDPStrategy"
    yield PrivateName(fsdp, sharded.STATE_DICT_TYPE, lambda: ns.pl("strategies.FSDPStrategy")())
    ddp = f"{pl_}.strategies.DDPStrategy"
    yield PrivateName(ddp, fabric_names.DDP_KWARGS, lambda: ns.pl("strategies.DDPStrategy")())
    for where, name, owner in fabric_names.private_names(ns):
        yield PrivateName(where, name, owner)
    for where, needs, attributes, owner in logger_owners(ns):
        for name in attributes:
            yield PrivateName(where, name, owner, needs)


def private_names() -> tuple[PrivateName, ...]:
    """Every private Lightning name ray_lightning relies on, in every installed namespace."""
    names = [name for ns in namespaces.installed() for name in _private_names(ns)]
    for where, needs, attributes, owner in third_party_owners():
        names += [PrivateName(where, name, owner, needs) for name in attributes]
    return tuple(names)


PRIVATE_NAMES: tuple[PrivateName, ...] = private_names()
