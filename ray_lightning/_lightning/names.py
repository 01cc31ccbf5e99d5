"""Private Lightning functions, classes and attributes, under names of our own.

Each is used because no public API does the job:

* ``_Launcher``: the base class Lightning's strategies expect from ``strategy.launcher``.
* ``_init_dist_connection``: Lightning's process-group setup (sets ``torch.distributed``'s env
  and logs), called with our own store so the group meets on rank 0's OS-chosen port.
* ``_MockOptimizer``: Lightning's stand-in when a module has no optimizer; Horovod must not wrap it.
* ``_is_local_file_protocol``: which directories are local files (remote URLs are left alone).
* ``Trainer._default_root_dir``, the loggers' ``_root_dir``/``_save_dir``: the directories rank 0
  writes into, which have no public setters (rank 0 off the driver's machine stages them).
* The private attributes of the W&B, MLflow and Comet loggers (:mod:`.loggers`).
* The fit loop's progress counters and ``_batches_that_stepped`` (the step loggers are given):
  restored on the driver so ``current_epoch``/``global_step`` are rank 0's after ``fit``, and a
  second ``fit`` logs its metrics at the steps after the first's, as in Lightning.

:data:`PRIVATE_NAMES` lists every private name of this folder with where Lightning keeps it;
``tests/test_lightning_internals.py`` checks each and names any that moved.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_fabric.utilities.cloud_io import _is_local_file_protocol
from lightning_fabric.utilities.distributed import _init_dist_connection
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.core.optimizer import _MockOptimizer
from pytorch_lightning.strategies.launchers.launcher import _Launcher

from ray_lightning._lightning.loggers import LOGGER_OWNERS

if TYPE_CHECKING:
    import pytorch_lightning as pl

Launcher = _Launcher
init_dist_connection = _init_dist_connection
is_local_file_protocol = _is_local_file_protocol

# Where the Trainer, its loggers and checkpoint callbacks keep the directories they write into.
TRAINER_DIRECTORIES = ("_default_root_dir",)
LOGGER_DIRECTORIES = ("_root_dir", "_save_dir")  # CSVLogger, TensorBoardLogger (and their fabric bases)
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


def is_mock_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is Lightning's stand-in for a module that configured none."""
    return isinstance(optimizer, _MockOptimizer)


def directory_holders(trainer: pl.Trainer) -> Iterator[tuple[Any, tuple[str, ...]]]:
    """``(object, attribute names)`` for everything that holds a directory or file rank 0 writes to."""
    yield trainer, TRAINER_DIRECTORIES
    for logger in trainer.loggers:
        yield logger, LOGGER_DIRECTORIES
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint):
            yield callback, CHECKPOINT_PATHS


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


def load_fit_progress(trainer: pl.Trainer, state: dict[str, Any]) -> None:
    for key, path in FIT_PROGRESS:
        _progress(trainer, path).load_state_dict(state[key])
    for key, path in FIT_COUNTERS:
        if key in state:
            setattr(*_owner_and_name(trainer, path), state[key])


@dataclass(frozen=True)
class PrivateName:
    """One private Lightning name we rely on: ``name`` on what ``owner`` finds (a module, class or object)."""

    where: str
    name: str  # may be dotted: a path of attributes
    owner: Callable[[], Any]
    needs: str | None = None  # the optional package the owner needs (a logger's), if any

    def missing(self) -> str | None:
        """None if the name is still there; else what is missing."""
        try:
            obj = self.owner()
        except Exception as error:  # noqa: BLE001 - whatever broke is what moved
            return f"{self.where}: cannot get it ({type(error).__name__}: {error})"
        for part in self.name.split("."):
            if not hasattr(obj, part):
                return f"{self.where} has no {self.name} (no {part!r} on {type(obj).__name__})"
            obj = getattr(obj, part)
        return None


def _module(name: str) -> Callable[[], Any]:
    import importlib

    return lambda: importlib.import_module(name)


def _connector() -> Any:
    from ray_lightning._lightning.connector import connector_class

    return connector_class()


def _ddp_strategy() -> Any:
    from pytorch_lightning.strategies import DDPStrategy

    return DDPStrategy()


def _trainer() -> Any:
    import pytorch_lightning as pl

    return pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)


def _logger(kind: str) -> Callable[[], Any]:
    def make() -> Any:
        from pytorch_lightning import loggers

        return getattr(loggers, kind)(os.devnull)

    return make


def _fit_loop() -> Any:
    return _trainer().fit_loop


PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName("pytorch_lightning.strategies.launchers.launcher", "_Launcher", _module(_Launcher.__module__)),
    PrivateName(
        "lightning_fabric.utilities.distributed", "_init_dist_connection", _module(_init_dist_connection.__module__)
    ),
    PrivateName("pytorch_lightning.core.optimizer", "_MockOptimizer", _module("pytorch_lightning.core.optimizer")),
    PrivateName(
        "lightning_fabric.utilities.cloud_io", "_is_local_file_protocol", _module(_is_local_file_protocol.__module__)
    ),
    PrivateName(
        "pytorch_lightning.trainer.connectors.accelerator_connector",
        "_AcceleratorConnector",
        _module("pytorch_lightning.trainer.connectors.accelerator_connector"),
    ),
    *(
        PrivateName("_AcceleratorConnector", m, _connector)
        for m in ("_check_config_and_set_final_flags", "_choose_strategy", "_init_strategy")
    ),
    PrivateName("a Trainer's _AcceleratorConnector", "_strategy_flag", lambda: _trainer()._accelerator_connector),
    PrivateName("pytorch_lightning.Trainer", "_default_root_dir", _trainer),
    PrivateName("pytorch_lightning.loggers.CSVLogger", "_root_dir", _logger("CSVLogger")),
    PrivateName("pytorch_lightning.loggers.CSVLogger", "_save_dir", _logger("CSVLogger")),
    PrivateName("pytorch_lightning.loggers.TensorBoardLogger", "_root_dir", _logger("TensorBoardLogger")),
    PrivateName("pytorch_lightning.strategies.Strategy", "_accelerator", _ddp_strategy),
    PrivateName("pytorch_lightning.strategies.Strategy", "_launcher", _ddp_strategy),
    PrivateName("pytorch_lightning.strategies.Strategy", "_lightning_optimizers", _ddp_strategy),
    PrivateName("pytorch_lightning.strategies.Strategy", "_configure_launcher", _ddp_strategy),
    PrivateName("pytorch_lightning.strategies.DDPStrategy", "_timeout", _ddp_strategy),
    PrivateName("pytorch_lightning.strategies.DDPStrategy", "_process_group_backend", _ddp_strategy),
    PrivateName("pytorch_lightning.strategies.DDPStrategy", "_get_process_group_backend", _ddp_strategy),
    *(PrivateName("pytorch_lightning.Trainer.fit_loop", path, _fit_loop) for _, path in FIT_PROGRESS + FIT_COUNTERS),
    *(
        PrivateName(where, name, owner, needs)
        for where, needs, attributes, owner in LOGGER_OWNERS
        for name in attributes
    ),
)
