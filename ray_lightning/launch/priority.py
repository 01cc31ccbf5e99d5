"""A worker's CPU priority during a call: the niceness of the process that called ``fit``, as under Lightning.

Ray starts every worker process at niceness 15 (its ``worker_niceness`` setting), so that the raylet
and Ray's other processes keep their share of a busy node. A rank at 15 gives up its core to any
process of normal priority the moment that one wakes: where the ranks have all the cores, each wakeup
of Ray's own processes, the driver or anything else on the machine preempts a rank in the middle of
its step, and the other ranks wait for it in the next collective; on a busy machine the ranks get a
small fraction of their share. Lightning's launchers start their ranks at the niceness of the script
(``ddp_spawn`` forks, ``ddp`` re-runs it). Measured with 2 workers on 2 cores
(``benchmarks/README.md``, "A step of a few milliseconds"), niceness 15 was what made RayStrategy's
steps cost more CPU and time than ``ddp_spawn``'s.

So for the length of a call every thread of the worker process takes the driver's niceness (threads
started during the call inherit it), and gets Ray's back after the call, while the process waits for
the next one. Lowering the niceness needs the right to (root, ``CAP_SYS_NICE`` or ``RLIMIT_NICE``):
without it the worker keeps Ray's, as before (``RAY_worker_niceness=0`` when starting Ray sets every
worker's).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

_rays: int | None = None  # the niceness Ray gave this process, while it runs at another one


def current_niceness() -> int | None:
    """The niceness of the calling thread (on Linux each thread has its own); None where the OS has none."""
    if not hasattr(os, "getpriority"):
        return None
    return os.getpriority(os.PRIO_PROCESS, 0)


def _threads() -> list[int]:
    # Linux keeps a niceness per thread; elsewhere PRIO_PROCESS 0 is the whole process.
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _set_all(value: int) -> None:
    """Every thread of this process at ``value``, where allowed."""
    for tid in _threads():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, value)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as error:  # PermissionError: lowering it takes a right this process lacks
            log.debug("ray_lightning: the worker keeps its niceness, not the driver's %s: %s", value, error)
            return


def hold(value: int | None) -> None:
    """Every thread of this process at the niceness ``value`` (None: leave it) until :func:`release`."""
    global _rays
    before = current_niceness()
    if value is None or before is None or (before == value and _rays is None):
        return
    if _rays is None:
        _rays = before
    _set_all(value)


def release() -> None:
    """Every thread back at the niceness Ray gave the process (raising it is always allowed)."""
    global _rays
    if _rays is not None:
        _set_all(_rays)
        _rays = None
