"""Smoke test of the spot-pattern benchmark (benchmarks/elastic.py): tiny sizes, every contender once.

It checks that the harness runs on its own multi-node cluster, that the spot pattern happened (a worker node lost
and one back) for each contender that has it, that every contender trained its samples and wrote its row; it asserts
no time, ratio or accuracy (those depend on the machine; see benchmarks/README.md for the real run).
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.elastic_driver import CONTENDERS
from benchmarks.elastic_report import METRICS
from tests.benchmark_runs import run_benchmark

# The benchmark starts its own Ray cluster (a head and three worker nodes) in a subprocess, never the tests' Ray.
BENCHMARK_TIMEOUT_S = 600
pytestmark = pytest.mark.timeout(BENCHMARK_TIMEOUT_S + 120)
# Filled only where the pattern reaches them in a tiny run (a fit may end before a grown group trains).
_MAY_BE_MISSING = {"absence_s", "recovery_s", "grow_s", "decide_s", "acc_delta"}


def test_elastic_benchmark_writes_a_row_per_contender_and_plays_the_spot_pattern(tmp_path):
    args = ("--tiny", "--repeats", "1", "--name", "smoke", "--timeout", "300")
    code, log = run_benchmark("elastic", tmp_path, BENCHMARK_TIMEOUT_S, *args)
    assert code == 0, log[-8000:]

    document = json.loads((tmp_path / "smoke.json").read_text())
    markdown = (tmp_path / "smoke.md").read_text()
    assert document["errors"] == []
    assert list(document["table"]) == list(CONTENDERS)
    for name, entry in document["table"].items():
        assert entry["repeats"] == 1 and f"| {entry['label']} |" in markdown, name
        assert entry["pattern_errors"] == [], (name, entry["pattern_errors"])
        for metric in METRICS:
            summary = entry["metrics"][metric.key]
            if summary is None:
                assert metric.key in _MAY_BE_MISSING, (name, metric.key)
                continue
            assert all(math.isfinite(v) for v in summary["samples"]), (name, metric.key, summary)
    for measurement in document["measurements"]:
        name, contender = measurement["contender"], CONTENDERS[measurement["contender"]]
        assert 0.0 <= measurement["acc"] <= 1.0 and measurement["fit_s"] > 0, measurement
        # Every sample was trained (work redone after a restart counts on top).
        assert measurement["metrics"]["samples_percent"] >= 99.0, (name, measurement["metrics"])
        events = [e["event"] for e in measurement["events"]]
        sizes = [a["world_size"] for a in measurement["attempts"]]
        if contender.pattern is None:
            assert events == [] and sizes == [3], (name, events, sizes)
            continue
        # A worker node other than rank 0's was lost at 30% of the samples, and one came back.
        assert events == ["lost", "back"], (name, measurement["events"])
        assert measurement["events"][0]["rank"] not in (0, None), measurement["events"]
        assert sizes[0] == 3 and len(sizes) >= 2, (name, sizes)
        if name in ("elastic", "ray_train"):
            assert 2 in sizes, (name, sizes)  # went on with fewer workers
        if name == "elastic":
            restarts = measurement["restarts"]
            assert restarts and restarts[0]["world_size"] == 2, restarts
    # The goals are judged once every contender ran.
    assert all(t["status"] != "unknown" for t in document["targets"]), document["targets"]
    assert all(t["target"] in markdown for t in document["targets"])
