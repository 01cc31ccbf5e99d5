"""A fresh driver process per measurement (``python -m <entry> --contender .. --spec .. --result ..``, each in a
process group of its own, killed with all its children when it ends or times out): its measurement, or an error with
the end of its log; once more after a crash (:func:`_measure_or_again`). :mod:`benchmarks.run` runs them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
_LOG_TAIL = 4000


def measure_once(
    name: str,
    spec_path: str,
    result_path: str,
    log_path: str,
    env: dict[str, str],
    timeout: float,
    entry: str = "benchmarks.measure",
):
    """One contender in a fresh driver process (``python -m entry``; with tiny sizes forked from a warm process,
    :class:`benchmarks.measure.WarmDriver`); returns its measurement or raises with the end of its log."""
    from benchmarks.measure import WarmDriver

    if WarmDriver.wanted(spec_path):
        warm = WarmDriver.of({**os.environ, **env}, str(ROOT))
        returncode = warm.run(entry, _driver_args(name, spec_path, result_path), log_path, {**os.environ, **env},
                              timeout)  # fmt: skip
        return _measurement(name, result_path, log_path, returncode, timeout)
    # Its own process group: ddp's and ddp_spawn's ranks go with it, whatever happens.
    with open(log_path, "w") as log, driver_process(entry, name, spec_path, result_path, log, env) as process:
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
    return _measurement(name, result_path, log_path, returncode, timeout)


def _driver_args(contender: str, spec_path: str, result_path: str) -> list[str]:
    return ["--contender", contender, "--spec", spec_path, "--result", result_path]


@contextlib.contextmanager
def process_group(command: list[str], log: IO[str], **popen: Any) -> Iterator[subprocess.Popen]:
    """``command`` (``Popen``'s other arguments: ``popen``) in a process group of its own, its output to ``log``;
    the whole group is SIGKILLed when the block ends, however it ends."""
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **popen)
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def driver_process(
    entry: str, contender: str, spec_path: str, result_path: str, log: IO[str], env: dict[str, str]
) -> contextlib.AbstractContextManager[subprocess.Popen]:
    """A driver process, ``python -m entry --contender .. --spec .. --result ..`` from the repository root with
    ``env``, in a :func:`process_group`."""
    command = [sys.executable, "-m", entry, *_driver_args(contender, spec_path, result_path)]
    return process_group(command, log, cwd=ROOT, env={**os.environ, **env})


def log_tail(path: Path | str, size: int = _LOG_TAIL) -> str:
    """The end of a log file (its last ``size`` characters)."""
    with open(path, errors="replace") as f:
        return f.read()[-size:]


def _measurement(name: str, result_path: str, log_path: str, returncode: int | None, timeout: float) -> Any:
    if returncode == 0 and os.path.isfile(result_path):
        with open(result_path) as f:
            return json.load(f)
    tail = log_tail(log_path)
    what = f"did not finish within {timeout:g} s" if returncode is None else f"exited with {returncode}"
    crashed = returncode is None or returncode < 0 or any(sign in tail for sign in _NOT_THE_CODE)
    raise (MeasurementCrashed if crashed else RuntimeError)(
        f"the {name} driver process {what}; end of {log_path}:\n{tail}"
    )


# What the end of a failed driver's log says when the machine, not the measured code, failed it: torch's spawn when
# one of its processes died of a signal (ddp_spawn's ranks), and torch's TCPStore when another process took the port
# Lightning picked for the rendezvous between the pick and the bind (ddp_spawn, once in a full suite, 2026-11-30).
_NOT_THE_CODE = ("terminated with signal", "EADDRINUSE")


class MeasurementCrashed(RuntimeError):
    """A driver process, or a rank it spawned, was killed by a signal (SIGABRT, SIGSEGV), did not finish within its
    timeout (a hang), or lost its rendezvous port to another process: not an error of the measured code's Python."""


def _measure_or_again(contender: str, repeat: int, scratch: str, logs: Path, run: Callable[[str, str], Any]) -> Any:
    """``run(result_path, log_path)``; once more after a crash, the first crash kept in the result.

    Why once: Lightning's ddp_spawn baseline has aborted in gloo's teardown ("terminate called without an active
    exception", SIGABRT) in one of many CI runs, and a Ray Train v2 trial of the Tune smoke stopped reporting for
    minutes in one full suite (2026-11-29); one such crash or hang should cost a run its baseline no more than it
    would a user, who runs again. A contender that crashes twice, or fails otherwise, is a failed measurement."""
    result_path = os.path.join(scratch, f"{contender}-{repeat}.json")
    try:
        return run(result_path, str(logs / f"{contender}-{repeat}.log"))
    except MeasurementCrashed as crash:
        print(f"{crash}\nmeasuring {contender}, repeat {repeat + 1} again after that", file=sys.stderr, flush=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(result_path)
        result = run(result_path, str(logs / f"{contender}-{repeat}-again.log"))
        return {**result, "crashed_before": str(crash)}
