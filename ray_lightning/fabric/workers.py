"""What every Fabric strategy on Ray actors shares: the Trainer strategies' workers and process group, Fabric's
private hooks, the paths ``fabric.save``/``fabric.load`` use in a worker, and progress from collectives.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from typing_extensions import override

from ray_lightning import _lightning, namespaces, runtime
from ray_lightning.environment import RayEnvironment
from ray_lightning.home import files, loggers, storage
from ray_lightning.namespaces import Namespace
from ray_lightning.runtime import WorkerContext
from ray_lightning.strategies.in_worker import mixed_precision_is_stale
from ray_lightning.strategies.workers import RayWorkersMixin


class RayFabricWorkers(_lightning.fabric.FabricStrategyHooks, RayWorkersMixin):
    """What every Fabric strategy on Ray actors shares; see :mod:`ray_lightning.fabric.strategies`.

    Args:
        source: the Trainer strategy whose workers it runs on (``RayStrategy(num_workers=4)``); None builds one
            from ``strategy_kwargs`` (what ``Fabric(strategy="ray")`` does, with the defaults).
    """

    lightning_fabric = True
    # The Trainer strategy this is the Fabric form of.
    trainer_strategy: ClassVar[type]
    # Off the driver's node every rank stages, in one directory per node (launch.contexts): a sharded
    # checkpoint's parts, and what the node's other ranks read of rank 0's.
    every_rank_writes = True
    # fabric.save writes as the user's loop calls it (with storage_path: in the run's folder), not in the background.
    writes_in_background = False

    def __init__(self, source: Any = None, /, **strategy_kwargs: Any) -> None:
        if source is None:
            source = namespaces.member(self.trainer_strategy, self._namespace())(**strategy_kwargs)
        elif strategy_kwargs:
            raise TypeError(f"{type(self).__name__}(source, ...) takes no other arguments: {sorted(strategy_kwargs)}")
        self.source = source
        self.registry_name = source.registry_name
        self.init_arguments = dict(source.init_arguments)
        self.use_workers(source.workers)
        self.restarts = source.restarts  # the user's strategy object shows this one's restarts
        self.driver_cwd: str | None = None
        self.run_url: str | None = None  # with storage_path: the run's folder, where relative paths go
        self.loggers: list[Any] = []
        self._staging: str | None = None
        self._localizing: tuple[Any, Any, Any] | None = None
        self._cwd_before: str | None = None
        self.fabric_init(source)
        self.cluster_environment = namespaces.member(RayEnvironment, self._namespace())(self.num_workers)

    def _namespace(self) -> Namespace:
        return type(self).namespace or namespaces.primary()

    def fabric_init(self, source: Any) -> None:
        """Fabric's strategy ``__init__``, with the arguments ``source`` (the Trainer strategy) holds."""
        raise NotImplementedError

    def fabric_base(self) -> type:
        """Fabric's strategy class this one extends."""
        return self.namespace.fabric(self.lightning_base)

    @override
    def make_launcher(self) -> Any:
        from ray_lightning.fabric.launcher import RayFabricLauncher

        return RayFabricLauncher(self)

    @override
    def adapt_precision_to_device(self) -> None:
        # Changed in place: the Fabric object and the modules it set up hold this very plugin.
        plugin = self.precision
        mixed_precision = self.namespace.fabric("plugins.precision.MixedPrecision")
        if type(plugin) is mixed_precision and mixed_precision_is_stale(plugin, self.root_device.type):
            vars(plugin).update(vars(mixed_precision(plugin.precision, self.root_device.type)))

    # -- in a worker --------------------------------------------------------------------------------------

    @override
    def join_process_group(self) -> None:
        super().join_process_group()
        # From here on the watchdog bounds the time between two steps of progress (progress_timeout_s).
        runtime.mark_progress("training", "the launched function")

    @override
    def attach_worker(self, context: WorkerContext, rendezvous_store: Any, staging: str | None = None) -> None:
        """Also: run in the driver's working directory where this node has it; write under ``staging`` if given
        (this node's staging directory: it is not the driver's)."""
        super().attach_worker(context, rendezvous_store)
        self._staging = staging
        self._cwd_before = os.getcwd()
        if self.driver_cwd is not None and os.path.isdir(self.driver_cwd):
            os.chdir(self.driver_cwd)
        if context.rank.global_rank != 0:
            return
        if staging is not None:
            files.map_logger_paths(self.loggers, lambda p: files.to_staged(p, staging) if os.path.isabs(p) else p)
        # A rerun after a restart, or a later launch with the same loggers: their files so far are kept.
        loggers.continue_fabric_logs(self.loggers)

    def function_ended(self, succeeded: bool) -> None:
        """In a worker, after the launched function returned or raised: rank 0's loggers write what they hold
        (Fabric's CSVLogger keeps up to 100 steps in memory; the worker process outlives the call); after a
        success, every rank waits until all wrote their files (a node's staging directory is sent once)."""
        for logger in self.loggers:
            logger.finalize("success" if succeeded else "failed")
        if succeeded:
            self.fabric_base().barrier(self, "ray_lightning: every rank's files written")

    @override
    def detach_worker(self) -> None:
        super().detach_worker()
        if self._cwd_before is not None and os.path.isdir(self._cwd_before):
            os.chdir(self._cwd_before)
        self._staging = self._cwd_before = None

    def _written_path(self, path: Any) -> Any:
        """Where this worker writes ``path``: with ``storage_path`` a relative path in the run's folder; else the
        driver's path, or its place under this rank's staging directory."""
        if not isinstance(path, (str, os.PathLike)) or not _lightning.is_local_file_protocol(path):
            return path
        path = os.path.expanduser(os.fspath(path))
        if self.run_url is not None and not os.path.isabs(path):
            return storage.join(self.run_url, path)
        absolute = os.path.abspath(path)
        if self._staging is None or self._staged(absolute):
            return absolute  # already staged: a path made from a staged logger's log_dir
        return files.to_staged(absolute, self._staging)

    def _read_path(self, path: Any) -> Any:
        """Where this worker reads ``path``: what a rank of this node staged in this call, else the path (in the
        run's folder when relative, with ``storage_path``)."""
        written = self._written_path(path)
        if self._staging is None or not isinstance(written, str) or os.path.exists(written):
            return written
        return os.path.abspath(os.path.expanduser(os.fspath(path)))

    def _staged(self, path: str) -> bool:
        return self._staging is not None and path.startswith(self._staging + os.sep)

    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: Any | None = None
    ) -> None:
        runtime.mark_progress("fabric.save", str(path))
        with self._localized(path, self._written_path):
            self.fabric_base().save_checkpoint(self, self._written_path(path), state, storage_options, filter)

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, **kwargs: Any) -> Any:
        runtime.mark_progress("fabric.load", str(path))
        with self._localized(path, self._read_path):
            return self.fabric_base().load_checkpoint(self, self._read_path(path), state, strict, **kwargs)

    @contextlib.contextmanager
    def _localized(self, path: Any, where: Callable[[Any], Any]) -> Iterator[None]:
        """While saving or loading ``path``: Fabric's sharded strategies broadcast rank 0's path to every rank
        (:meth:`broadcast`), which is each rank's own here (its staging directory, or the driver's path)."""
        self._localizing = (os.fspath(where(path)) if isinstance(path, (str, os.PathLike)) else None, path, where)
        try:
            yield
        finally:
            self._localizing = None

    # Progress for the hang watchdog: a rank that makes none for progress_timeout_s is stuck.

    @override
    def backward(self, tensor: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        runtime.mark_progress("training", "backward")
        self.fabric_base().backward(self, tensor, module, *args, **kwargs)

    @override
    def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        runtime.mark_progress("training", "all_reduce")
        return self.fabric_base().all_reduce(self, tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
        runtime.mark_progress("training", "all_gather")
        return self.fabric_base().all_gather(self, tensor, group=group, sync_grads=sync_grads)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        runtime.mark_progress("training", "barrier")
        self.fabric_base().barrier(self, *args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        runtime.mark_progress("training", "broadcast")
        result = self.fabric_base().broadcast(self, obj, src)
        localizing = getattr(self, "_localizing", None)
        if localizing is None or not isinstance(result, (str, os.PathLike)):
            return result
        self._localizing = None  # the one broadcast of the path, in Fabric's save/load
        if os.fspath(result) == localizing[0]:
            return result
        # Rank 0's own path for the checkpoint this rank is saving or loading: use this rank's.
        own = localizing[2](localizing[1])
        return type(result)(own) if isinstance(result, os.PathLike) else own
