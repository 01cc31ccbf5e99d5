"""What the launcher and the worker actor need from a strategy, so that ``launch`` never imports ``strategies``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ray_lightning.config import RecoverySettings, WorkerResources
from ray_lightning.launch.rendezvous import Rendezvous
from ray_lightning.runtime import WorkerContext

if TYPE_CHECKING:
    import pytorch_lightning as pl


class LaunchedStrategy(Protocol):
    """A ray_lightning strategy, as the launcher (on the driver) and the worker actor see it."""

    resources: WorkerResources
    init_hook: Callable[[], Any] | None
    placement_timeout_s: float
    worker_start_timeout_s: float
    keep_workers_alive_s: float
    progress_timeout_s: float | None
    scale_up_timeout_s: float
    recovery: RecoverySettings
    restarts: list[Any]

    @property
    def rendezvous(self) -> Rendezvous:
        """How this strategy's workers meet."""

    def check_trainer(self, trainer: pl.Trainer) -> None:
        """On the driver, before any worker starts: refuse a Trainer this strategy cannot run."""

    def attach_worker(self, context: WorkerContext, rendezvous_store: Any) -> None:
        """In a worker, before the call: take this worker's rank, device and rendezvous."""

    def detach_worker(self) -> None:
        """In a worker, after a call succeeded: leave the process group so the next call can form its own."""
