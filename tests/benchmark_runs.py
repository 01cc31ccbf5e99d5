"""Running a benchmark harness as the smoke tests do: its own process, a time bound, its log."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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


def check_every_metric(
    document: dict, markdown: str, contenders: Iterable[str], metrics: Iterable[Any], baseline: str
) -> None:
    """A smoke run's table: every contender once, each metric of each written, finite, with a ratio to ``baseline``."""
    assert document["errors"] == []
    assert list(document["table"]) == list(contenders)
    for name, entry in document["table"].items():
        assert entry["repeats"] == 1 and entry["label"] in markdown
        for metric in metrics:
            summary = entry["metrics"][metric.key]
            assert summary is not None, (name, metric.key)
            assert all(math.isfinite(v) and v >= 0 for v in summary["samples"]), (name, metric.key, summary)
            assert math.isfinite(summary.get("ratio_vs_" + baseline, 0.0)), (name, metric.key)
