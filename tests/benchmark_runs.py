"""Running a benchmark harness as the smoke tests do: its own process, a time bound, its log."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(module: str, out: Path, timeout_s: float, *args: str) -> tuple[int, str]:
    """``python -m benchmarks.<module> --out <out> *args`` from the repository root; past ``timeout_s`` it gets
    SIGTERM, which stops its driver processes and its own Ray cluster (never the tests' Ray)."""
    log_path = out / f"{module}.log"
    with open(log_path, "w") as log:
        benchmark = subprocess.Popen(
            [sys.executable, "-m", f"benchmarks.{module}", "--out", str(out), *args],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            code = benchmark.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            benchmark.send_signal(signal.SIGTERM)
            benchmark.wait(timeout=120)
            pytest.fail(f"benchmarks.{module} ran over {timeout_s} s:\n{log_path.read_text()[-8000:]}")
    return code, log_path.read_text()
