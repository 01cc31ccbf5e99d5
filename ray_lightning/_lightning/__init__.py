"""Every private Lightning name ray_lightning uses or patches, and nothing else.

Lightning's public API has no hook for some of what a Ray-backed strategy must do; where none
exists, the private name is touched here and only here, so that a Lightning release that moves
one breaks one folder, and ``tests/test_lightning_internals.py`` names what moved:

* :mod:`.connector`: ``_AcceleratorConnector`` is patched so that ``Trainer(accelerator=RayAccelerator(...))``
  brings its own strategy and the workers' GPUs, not the driver's hardware, choose the device.
* :mod:`.strategy`: the private attributes and hooks of Lightning's strategies (``_accelerator``,
  ``_launcher``, ``_configure_launcher``, DDP's ``_timeout``/``_process_group_backend``/
  ``_get_process_group_backend``, ``_lightning_optimizers``), behind public names of our own.
* :mod:`.names`: private functions and classes imported from Lightning (``_Launcher``,
  ``_init_dist_connection``, ``_MockOptimizer``, ``_is_local_file_protocol``) and the private
  directory attributes of the Trainer and loggers, and the fit loop's progress counters.
* :mod:`.sharded`: the device mesh's private homes, the sharded-checkpoint switch and fabric's
  loading helpers, for the sharded strategies.
* :mod:`.loggers`: the private attributes of the W&B, MLflow and Comet loggers (their runs, where
  they store them, what they logged), W&B's pickling without a run, and MLflow's own artifact-repository
  cache (the one private name of a logger's library).

:data:`PRIVATE_NAMES` lists all of them; a test checks each still exists.
"""

from ray_lightning._lightning import fabric, sharded
from ray_lightning._lightning.connector import (
    BringsItsStrategy,
    ChoosesItsAccelerator,
    ensure_installed,
    install,
    raise_not_converted,
)
from ray_lightning._lightning.names import (
    PRIVATE_NAMES,
    batches_processed,
    directory_holders,
    dump_checkpoint,
    fit_progress_state,
    init_dist_connection,
    is_last_batch,
    is_local_file_protocol,
    is_mock_optimizer,
    launcher_bases,
    load_fit_progress,
    logger_directory_holders,
    output_directories,
    set_batches_done,
    settle_failed_batch,
    use_filesystems_of_logger_paths,
    use_filesystems_of_paths,
)
from ray_lightning._lightning.strategy import LightningStrategyHooks

__all__ = [
    "PRIVATE_NAMES",
    "BringsItsStrategy",
    "ChoosesItsAccelerator",
    "LightningStrategyHooks",
    "directory_holders",
    "dump_checkpoint",
    "ensure_installed",
    "batches_processed",
    "set_batches_done",
    "settle_failed_batch",
    "fit_progress_state",
    "init_dist_connection",
    "is_last_batch",
    "launcher_bases",
    "install",
    "is_local_file_protocol",
    "use_filesystems_of_logger_paths",
    "use_filesystems_of_paths",
    "is_mock_optimizer",
    "load_fit_progress",
    "logger_directory_holders",
    "output_directories",
    "raise_not_converted",
    "fabric",
    "sharded",
]
