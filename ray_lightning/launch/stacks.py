"""Python stacks of worker processes, taken from outside while they are stuck.

A 0-CPU task pinned to the worker's node runs ``py-spy dump --pid`` (py-spy comes with
``ray[default]``; it reads another process's memory, so it works while the worker is blocked in C,
a collective or ``time.sleep``). Where py-spy is missing or not allowed to attach (Yama
``ptrace_scope``, containers without ``SYS_PTRACE``), the fallback is :mod:`faulthandler`: every
worker registers it on ``SIGUSR1`` when it starts (:func:`enable_signal_dump`), writing all threads'
stacks to a file of its own, which the task signals and reads. The signal is only ever sent to a
process that registered the handler (SIGUSR1's default action ends a process).

No file is left behind, however the worker ends. On Linux the dump file has no name at all: an
anonymous in-memory file (``memfd_create``), which the kernel frees with the process, SIGKILL
included; the task finds it among the worker's open files (``/proc/<pid>/fd``, readable by a
process of the same user even where Yama keeps py-spy from attaching) and reads it there. Elsewhere
(macOS, or a sandbox that refuses ``memfd_create``) it is ``ray_lightning-stack-<pid>.txt`` in the
temporary directory, removed when the worker exits normally (:mod:`atexit`); the file of a killed
worker is removed by the next worker that starts on the machine and by the next stack taken there
(:func:`remove_dead_dumps`, which also removes the files earlier versions left).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import glob
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
_MEMFD_NAME = "ray_lightning-stack"
_PREFIX, _SUFFIX = "ray_lightning-stack-", ".txt"  # a named dump file: <temp dir>/<prefix><pid><suffix>
# Anonymous dump files, found through /proc (Linux); else named ones.
_ANONYMOUS = hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")
_dump_fd: int | None = None  # kept open for as long as the handler is registered


def _dump_path(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"{_PREFIX}{pid}{_SUFFIX}")


def enable_signal_dump() -> None:
    """In a worker process: write every thread's stack to this process's dump file on SIGUSR1."""
    global _dump_fd
    if _dump_fd is not None or not hasattr(signal, "SIGUSR1"):
        return
    remove_dead_dumps()
    fd = _anonymous_file()
    if fd is None:
        path = _dump_path(os.getpid())
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError:
            return  # no fallback then: py-spy only
        atexit.register(_remove, path)
    faulthandler.register(signal.SIGUSR1, file=fd, all_threads=True)
    _dump_fd = fd


def _anonymous_file() -> int | None:
    """A file with no name (Linux), freed with the process; None where there is none (a sandbox may refuse one)."""
    if not _ANONYMOUS:
        return None
    try:
        return os.memfd_create(_MEMFD_NAME)  # close-on-exec
    except OSError:
        return None


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process
    return True


def remove_dead_dumps() -> None:
    """Remove the named dump files of this machine's processes that are gone (killed workers)."""
    for path in glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), f"{_PREFIX}*{_SUFFIX}")):
        pid = os.path.basename(path)[len(_PREFIX) : -len(_SUFFIX)]
        if pid.isdigit() and not _alive(int(pid)):
            _remove(path)


def _dump_target(pid: int) -> str | None:
    """Where ``pid``'s handler writes (a path this process can open), None if it registered none."""
    fds = f"/proc/{pid}/fd"
    if _ANONYMOUS:
        with contextlib.suppress(OSError):
            for fd in os.listdir(fds):
                with contextlib.suppress(OSError):
                    if os.readlink(f"{fds}/{fd}").startswith(f"/memfd:{_MEMFD_NAME} "):
                        return f"{fds}/{fd}"
    path = _dump_path(pid)
    return path if os.path.exists(path) else None


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
    target = _dump_target(pid) if hasattr(signal, "SIGUSR1") else None
    if target is None:
        return None  # the handler is not registered: the signal would end the process
    try:
        size = os.path.getsize(target)
        os.kill(pid, signal.SIGUSR1)
        # faulthandler writes from the signal handler: wait (bounded) until the file grew and stopped growing.
        deadline, last = time.monotonic() + _SIGNAL_DUMP_WAIT_S, size
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = os.path.getsize(target)
            if now > size and now == last:
                break
            last = now
        with open(target) as f:
            f.seek(size)
            return f.read() or None
    except OSError:
        return None  # the process ended meanwhile


def stack_of(pid: int) -> str:
    """The Python stacks of process ``pid`` on this node (runs as a task there)."""
    remove_dead_dumps()
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
