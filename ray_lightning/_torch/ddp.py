"""The wait for DDP's gradient all-reduce, read from the reducer's own sampled timings.

DDP's reducer times some of its iterations itself (the first ten, then one in a hundred: torch's
``kDDPRuntimeLoggingSampleRate``) and keeps the last one's marks in ``_get_ddp_logging_data()``. Read from there,
the wait costs the step nothing; a comm hook in Python, the other way to see it, cost ~1.5 ms of CPU per step on
the step benchmark (benchmarks/README.md, issue 38).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

LOGGING_DATA = "_get_ddp_logging_data"


def allreduce_wait_probe(model: Any) -> Callable[[], float | None]:
    """For a ``DistributedDataParallel`` module: a function returning the seconds its last sampled backward waited
    for the gradient all-reduce after its own gradients were done (None before any sample)."""

    def wait() -> float | None:
        data = getattr(model, LOGGING_DATA)()
        comm_end, compute_end = data.get("backward_comm_time_end"), data.get("backward_compute_time_end")
        if not comm_end or not compute_end:
            return None
        return max(0, comm_end - compute_end) / 1e9

    return wait
