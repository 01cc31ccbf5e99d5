"""What the launcher and the worker actor need from a strategy, so that ``launch`` never imports ``strategies``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ray_lightning.config.workers import WorkerSpec
from ray_lightning.launch.rendezvous import Rendezvous
from ray_lightning.runtime import WorkerContext

if TYPE_CHECKING:
    import pytorch_lightning as pl


class LaunchedStrategy(Protocol):
    """A ray_lightning strategy, as the launcher (on the driver) and the worker actor see it."""

    workers: WorkerSpec
    restarts: list[Any]
    state_in_every_rank: bool  # a restart may go on from the survivors' state (launch.memory)

    @property
    def rendezvous(self) -> Rendezvous:
        """How this strategy's workers meet."""

    @property
    def collective_errors(self) -> tuple[type[BaseException], ...]:
        """Exception types its collectives raise in the ranks that survive a peer's loss (besides torch's)."""

    def check_trainer(self, trainer: pl.Trainer) -> None:
        """On the driver, before any worker starts: refuse a Trainer this strategy cannot run."""

    def attach_worker(self, context: WorkerContext, rendezvous_store: Any) -> None:
        """In a worker, before the call: take this worker's rank, device and rendezvous."""

    def detach_worker(self) -> None:
        """In a worker, after a call succeeded: leave the process group so the next call can form its own."""
