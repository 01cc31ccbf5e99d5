"""Smoke test of the Tune benchmark (benchmarks/tune.py): tiny sizes, one PBT search per contender.

It checks that the harness runs, that every trial of both searches trained its budget without an error, that every
metric is written for both contenders and every goal judged; it asserts no time, ratio or exploit count (those
depend on the machine and on PBT's timing; see benchmarks/README.md for the real run).
"""

from __future__ import annotations

import json

import pytest

from benchmarks.tune import METRICS, TARGETS
from benchmarks.tune_measure import BASELINE, CONTENDERS
from tests.benchmark_runs import check_every_metric, run_benchmark

# The benchmark starts its own Ray cluster in a subprocess (never the tests' Ray); two tiny searches.
BENCHMARK_TIMEOUT_S = 600
pytestmark = pytest.mark.timeout(BENCHMARK_TIMEOUT_S + 120)


def test_tune_benchmark_writes_every_metric_for_both_contenders(tmp_path):
    args = ("--tiny", "--repeats", "1", "--name", "smoke", "--timeout", "300")
    code, log = run_benchmark("tune", tmp_path, BENCHMARK_TIMEOUT_S, *args)
    assert code == 0, log[-8000:]

    document = json.loads((tmp_path / "smoke.json").read_text())
    markdown = (tmp_path / "smoke.md").read_text()
    check_every_metric(document, markdown, CONTENDERS, METRICS, BASELINE)
    spec = document["spec"]
    for measurement in document["measurements"]:
        name = measurement["contender"]
        # Every trial of the population ran to its last report, and none failed.
        assert len(measurement["trials"]) == spec["trials"], (name, measurement["trials"])
        for trial in measurement["trials"]:
            assert trial["error"] is None and trial["iterations"] >= spec["reports"], (name, trial)
            assert 0 <= trial["acc"] <= 1, (name, trial)
        # Each trial's function started at least once, and rank 0 of each start reached a batch.
        assert {s["trial_id"] for s in measurement["starts"]} == {t["trial_id"] for t in measurement["trials"]}
        assert all(s["start_s"] is not None for s in measurement["starts"] if not s["restart"]), measurement["starts"]
    ours = [n for n in CONTENDERS if n != BASELINE]
    judged = {(t["contender"], t["target"]) for t in document["targets"] if t["status"] != "unknown"}
    assert judged == {(n, target) for n in ours for target, _, _ in TARGETS}
    assert all(t["target"] in markdown for t in document["targets"])
