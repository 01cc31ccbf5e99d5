"""The errors ray_lightning raises on the driver; each message says what happened and what to do."""

from __future__ import annotations


class ClusterResourceError(RuntimeError):
    """The cluster cannot hold the requested workers; the message says what was asked and what exists."""


class RayWorkerError(RuntimeError):
    """A worker raised or died. ``rank`` is its global rank; the message holds its traceback.

    ``failures``: after a fit restarted its workers (``max_failures``), the messages of the
    failures before this one, oldest first; this error's message repeats them.
    """

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.failures: list[str] = []

    def __reduce__(self) -> tuple:
        # Tune copies and Ray pickles exceptions; keep the rank (and the subclass) when they do.
        return (type(self), (str(self), self.rank), {"failures": self.failures})


class WorkerDiedError(RayWorkerError):
    """A worker process died while running the call: killed, out of memory, or its node was lost.

    ``preempted``: Ray reported that the node was drained for preemption before it died.
    """

    def __init__(self, message: str, rank: int, preempted: bool = False) -> None:
        super().__init__(message, rank)
        self.preempted = preempted

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.rank, self.preempted), {"failures": self.failures})


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
        return (type(self), (str(self), self.rank, self.ranks, self.phase), {"failures": self.failures})


class WorkerPreemptedError(RayWorkerError):
    """A worker's process or node is about to go away (SIGTERM, a node drained for preemption).

    Ends an attempt on the driver when rank 0 has taken a checkpoint because of it, so the fit restarts
    from there at once instead of waiting for the node to die; ``reason`` says who is going away.
    """

    def __init__(self, message: str, rank: int, reason: str = "") -> None:
        super().__init__(message, rank)
        self.reason = reason

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.rank, self.reason), {"failures": self.failures})


class WorkersGrowError(RayWorkerError):
    """Not a failure: an elastic fit (``num_workers=(min, max)``) ends an attempt to restart on more workers.

    Raised on the driver once workers started in room the fit holds (its own bundles placed again, or room reserved
    for it) are up: the cluster can hold ``size`` workers. The running processes leave their call at a batch and go
    on, the new workers beside them, from memory or from the newest checkpoint (:mod:`ray_lightning.launch.elastic`;
    ``trainer.strategy.restarts`` records it, ``max_failures`` does not count it). Never reaches the user.
    """

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message, rank=0)
        self.size = size

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.size), {"failures": self.failures})


class StorageError(OSError):
    """The run's storage (``storage_path``) cannot be written, or a checkpoint's upload failed: names the path."""
