"""Smoke test of the sharded-training benchmark (benchmarks/sharded.py): tiny sizes, every contender once.

It checks that the benchmark runs and writes every metric for every contender and judges every goal;
it asserts no time, ratio or goal's outcome (those depend on the machine; see benchmarks/README.md).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.sharded import METRICS
from benchmarks.sharded_workload import BARE, BASELINE, CONTENDERS, OURS
from tests.conftest import ROOT

# Four driver processes, each starting its workers, on 2 busy cores: minutes.
BENCHMARK_TIMEOUT_S = 1200
pytestmark = pytest.mark.timeout(BENCHMARK_TIMEOUT_S + 180)
# Not where rank 0 is the driver: nothing comes home, and no sampler takes the CPU of a driver that trains.
_NOT_ON_RANK_ZERO = {"weights_home_s", "weights_speed_vs_copy", "peak_shmem_mb"}


def _run_tiny_benchmark(out: Path) -> tuple[int, str]:
    """``python -m benchmarks.sharded --tiny --repeats 1``; past the bound it gets SIGTERM, on which it stops its
    driver processes and the Ray cluster it started (never the tests' own Ray), and the test fails."""
    command = [sys.executable, "-m", "benchmarks.sharded", "--tiny", "--repeats", "1", "--out", str(out),
               "--name", "smoke", "--timeout", "600"]  # fmt: skip
    log_path = out / "sharded.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            returncode = process.wait(timeout=BENCHMARK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.terminate()
            process.wait(timeout=150)
            pytest.fail(f"benchmarks.sharded ran over {BENCHMARK_TIMEOUT_S} s:\n{log_path.read_text()[-8000:]}")
    return returncode, log_path.read_text()


def _check_metrics(name: str, entry: dict, baseline: dict) -> None:
    contender = CONTENDERS[name]
    for metric in METRICS:
        summary = entry["metrics"][metric.key]
        if metric.key in _NOT_ON_RANK_ZERO and contender.driver_is_rank_zero:
            assert summary is None, (name, metric.key)
            continue
        assert summary is not None, (name, metric.key)
        assert summary["samples"] and all(math.isfinite(v) and v >= 0 for v in summary["samples"]), (name, summary)
        if name != BARE and metric.key != "model_mb" and baseline["metrics"][metric.key] is not None:
            assert math.isfinite(summary["ratio"]), (name, metric.key)


def test_sharded_benchmark_writes_every_metric_for_every_contender(tmp_path):
    returncode, output = _run_tiny_benchmark(tmp_path)
    assert returncode == 0, output[-8000:]

    document = json.loads((tmp_path / "smoke.json").read_text())
    markdown = (tmp_path / "smoke.md").read_text()
    assert document["errors"] == []
    table, skipped = document["table"], document["skipped"]
    # Every contender ran, but the FSDP1 ones where there are not enough GPUs (said in the table).
    assert set(table) | set(skipped) == set(CONTENDERS) and not set(table) & set(skipped)
    assert set(skipped) <= {"lightning_fsdp", "ray_fsdp1"}
    assert all(CONTENDERS[name].label in markdown for name in [*table, *skipped])
    for name, entry in table.items():
        assert entry["repeats"] == 1
        # The driver's module holds the full trained weights after fit, where they come home at all.
        assert entry["weights_returned"] is (None if CONTENDERS[name].driver_is_rank_zero else True), name
        _check_metrics(name, entry, table[BASELINE])
    for measurement in document["measurements"]:
        fit = measurement["fit"]
        assert fit["world_size"] == document["spec"]["workers"], measurement["contender"]
        assert fit["steps"] == document["spec"]["steps"], measurement["contender"]
    # Each goal judged for each of ray_lightning's contenders, in the table.
    goals, ran = document["goals"], {name for name in OURS if name in table}
    assert len(goals) == 3 * len(ran) and {g["contender"] for g in goals} == ran
    assert all(g["status"] in ("met", "missed") and g["goal"] in markdown for g in goals)
