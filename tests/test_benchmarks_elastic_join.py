"""Smoke test of the node-join benchmark (benchmarks/elastic_join.py), RayStrategy's contender only (Ray Train's takes
another two minutes and is measured by the benchmark itself): a third node joins a fit on two of (2, 3).

It checks what the benchmark's row says of the grow (from memory, in the running process, nothing trained twice), not
its times, which depend on the machine (see benchmarks/README.md for the real run).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.benchmark_runs import run_benchmark

# The benchmark starts its own Ray cluster (a head and up to three 1-CPU nodes) in a subprocess, never the tests' Ray.
BENCHMARK_TIMEOUT_S = 480
pytestmark = pytest.mark.timeout(BENCHMARK_TIMEOUT_S + 120)


def test_a_node_joining_a_fit_on_two_trains_on_three_in_the_running_processes(tmp_path):
    code, log = run_benchmark("elastic_join", tmp_path, BENCHMARK_TIMEOUT_S, "ray_lightning")
    assert code == 0, log[-8000:]
    (row,) = json.loads((tmp_path / "elastic_join.json").read_text())
    assert row["contender"] == "ray_lightning", row
    assert (row["source"], row["steps_trained_twice"], row["rank_zero_pids"]) == ("memory", 0, 1), row
    assert row["added_to_decided_s"] is not None, "the driver recorded when it decided the grow"
    for key in ("add_node_s", "added_to_decided_s", "added_to_training_on_3_s", "pause_s"):
        assert math.isfinite(row[key]) and row[key] >= 0, (key, row)
