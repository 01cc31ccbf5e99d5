"""Smoke test of the Fabric benchmark (benchmarks/fabric.py): tiny sizes, every contender once.

It checks that the harness runs, that both launches trained on every worker, that every metric is written for
every contender and every goal judged; it asserts no time or ratio (those depend on the machine; see
benchmarks/README.md for the real run).
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.fabric import METRICS, TARGETS
from benchmarks.fabric_measure import BASELINE, CONTENDERS, LAUNCHES
from tests.benchmark_runs import check_every_metric, run_benchmark

# Two fresh driver processes of two tiny launches each: about a minute on 2 quiet cores.
BENCHMARK_TIMEOUT_S = 900
pytestmark = pytest.mark.timeout(BENCHMARK_TIMEOUT_S + 120)


def test_fabric_benchmark_writes_every_metric_for_every_contender(tmp_path):
    args = ("--tiny", "--repeats", "1", "--name", "smoke", "--timeout", "600")
    code, log = run_benchmark("fabric", tmp_path, BENCHMARK_TIMEOUT_S, *args)
    assert code == 0, log[-8000:]

    document = json.loads((tmp_path / "smoke.json").read_text())
    markdown = (tmp_path / "smoke.md").read_text()
    check_every_metric(document, markdown, CONTENDERS, METRICS, BASELINE)
    spec = document["spec"]
    for measurement in document["measurements"]:
        for launch in LAUNCHES:
            # Each launch ran on every worker, with the steps asked for, and rank 0's clock came back.
            clock = measurement["launches"][launch]
            assert clock["world_size"] == spec["workers"], (measurement["contender"], launch)
            assert clock["steps"] == spec["steps"], (measurement["contender"], launch)
        # The first launch's start is split: rank 0's process created (Ray's may be there before the call), then
        # its function's start; the CPU that took.
        first = measurement["launches"][LAUNCHES[0]]
        assert math.isfinite(first["process_s"]), first
        assert first["process_to_function_s"] >= 0 and first["startup_cpu_s"] > 0, first
    # Every Ray contender is judged against every goal, and the judgement is in the table.
    ours = [n for n in CONTENDERS if n != BASELINE]
    judged = {(t["contender"], t["target"]) for t in document["targets"] if t["status"] != "unknown"}
    assert judged == {(n, target) for n in ours for target, _, _ in TARGETS}
    assert all(t["target"] in markdown for t in document["targets"])
