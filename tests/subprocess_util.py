"""Running an example as a user would: its own process, its own local Ray, a time bound, its output on failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def example_env() -> dict[str, str]:
    """This environment, with a local Ray of the example's own.

    ``ray.init()`` with no address joins a cluster another process started on this machine
    (``/tmp/ray/ray_current_cluster``); ``RAY_ADDRESS=local`` always starts a new one.
    """
    return dict(os.environ, RAY_ADDRESS="local", PYTHONUNBUFFERED="1")


def run_example(
    script: str, *args: str, cwd: Path, timeout_s: float, stderr_apart: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``python examples/<script> *args`` from ``cwd``; stderr goes into ``.stdout`` unless ``stderr_apart``.

    The script runs in a new process group so that on a timeout the local Ray it started goes with it.
    """
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if stderr_apart else subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=example_env(),
    )
    try:
        output, errors = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, errors = process.communicate()
        killed = subprocess.CompletedProcess(process.args, process.returncode, output, errors)
        pytest.fail(f"{script} {' '.join(args)} ran over {timeout_s} s; {explain(killed)}")
    return subprocess.CompletedProcess(process.args, process.returncode, output, errors)


def explain(result: subprocess.CompletedProcess[str]) -> str:
    """The exit status and the end of the output, for an assertion message."""
    stderr = f"\nstderr:\n{result.stderr[-6000:]}" if result.stderr else ""
    return f"exit {result.returncode}; output (last 6000 characters):\n{result.stdout[-6000:]}{stderr}"
