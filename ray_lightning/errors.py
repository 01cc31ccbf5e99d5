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


class WorkerHangError(RayWorkerError):
    """Rank(s) made no progress for longer than their bound (``progress_timeout_s`` or ``worker_start_timeout_s``).

    ``rank`` is the first stuck rank, ``ranks`` all of them, ``phase`` where they were; the message
    shows every rank's phase and Python stack at that moment.
    """

    def __init__(self, message: str, rank: int, ranks: list[int] | None = None, phase: str = "") -> None:
        super().__init__(message, rank)
        self.ranks = list(ranks) if ranks is not None else [rank]
        self.phase = phase

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.rank, self.ranks, self.phase))
