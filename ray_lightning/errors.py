"""The errors ray_lightning raises on the driver; each message says what happened and what to do."""

from __future__ import annotations


class ClusterResourceError(RuntimeError):
    """The cluster cannot hold the requested workers; the message says what was asked and what exists."""


class RayWorkerError(RuntimeError):
    """A worker raised or died. ``rank`` is its global rank; the message holds its traceback."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self) -> tuple:
        # Tune copies and Ray pickles exceptions; keep the rank (and the subclass) when they do.
        return (type(self), (str(self), self.rank))


class WorkerStartupError(RayWorkerError):
    """A worker died after it was started and before it ran the call (import error, killed, node lost)."""


class WorkerStartupTimeoutError(TimeoutError):
    """Started workers did not report in, or rank 0 did not open the rendezvous, within ``worker_start_timeout_s``."""
