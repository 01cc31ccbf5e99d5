"""Python stacks of worker processes, taken from outside while they are stuck.

A 0-CPU task pinned to the worker's node runs ``py-spy dump --pid`` (py-spy comes with
``ray[default]``; it reads another process's memory, so it works while the worker is blocked in C,
a collective or ``time.sleep``). Where py-spy is missing or not allowed to attach (Yama
``ptrace_scope``, containers without ``SYS_PTRACE``), the fallback is :mod:`faulthandler`: every
worker registers it on ``SIGUSR1`` when it starts (:func:`enable_signal_dump`), writing all threads'
stacks to a file of its own, which the task signals and reads. The signal is only ever sent to a
process that registered the handler (SIGUSR1's default action ends a process).
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import ray
from ray.exceptions import GetTimeoutError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

_PY_SPY_TIMEOUT_S = 20.0
_SIGNAL_DUMP_WAIT_S = 5.0
_dump_file = None  # kept open for as long as the handler is registered


def _dump_path(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"ray_lightning-stack-{pid}.txt")


def enable_signal_dump() -> None:
    """In a worker process: write every thread's stack to this process's dump file on SIGUSR1."""
    global _dump_file
    if _dump_file is None and hasattr(signal, "SIGUSR1"):
        _dump_file = open(_dump_path(os.getpid()), "a")  # noqa: SIM115 - must stay open for the handler
        faulthandler.register(signal.SIGUSR1, file=_dump_file, all_threads=True)


def _py_spy(pid: int) -> str | None:
    exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
    exe = exe if os.path.exists(exe) else shutil.which("py-spy")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=_PY_SPY_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 and done.stdout.strip() else None


def _signal_dump(pid: int) -> str | None:
    path = _dump_path(pid)
    if not hasattr(signal, "SIGUSR1") or not os.path.exists(path):
        return None  # the handler is not registered: the signal would end the process
    size = os.path.getsize(path)
    os.kill(pid, signal.SIGUSR1)
    # faulthandler writes from the signal handler: wait (bounded) until the file grew and stopped growing.
    deadline, last = time.monotonic() + _SIGNAL_DUMP_WAIT_S, size
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = os.path.getsize(path)
        if now > size and now == last:
            break
        last = now
    with open(path) as f:
        f.seek(size)
        return f.read() or None


def stack_of(pid: int) -> str:
    """The Python stacks of process ``pid`` on this node (runs as a task there)."""
    stack = _py_spy(pid) or _signal_dump(pid)
    return stack.rstrip() if stack else "(no stack: py-spy could not attach and no fallback dump was written)"


def collect_stacks(processes: Sequence[tuple[str, int]], timeout_s: float = 30.0) -> list[str]:
    """The stacks of the processes ``(node id, pid)``, each taken on its own node, in the same order."""
    task = ray.remote(num_cpus=0, max_retries=0)(stack_of)
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(pid)
        for node_id, pid in processes
    ]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    stacks = []
    for ref in refs:
        try:
            stacks.append(ray.get(ref, timeout=0))
        except GetTimeoutError:
            stacks.append(f"(no stack: taking it took longer than {timeout_s:g} s)")
        except Exception as error:  # noqa: BLE001 - the node may be gone; the hang is what matters
            stacks.append(f"(no stack: {type(error).__name__}: {error})")
    return stacks
