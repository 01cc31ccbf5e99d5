"""Smoke test of the small-step benchmark (benchmarks/step.py): tiny sizes, every contender once.

It checks that the harness runs and writes every metric for every contender and judges every target;
it asserts no time or ratio (those depend on the machine; see benchmarks/README.md for the real run).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from benchmarks.contenders import BASELINE
from benchmarks.step import METRICS, TARGETS
from benchmarks.step_measure import STEP_CONTENDERS
from tests.benchmark_runs import check_every_metric
from tests.conftest import ROOT

# Three fresh driver processes of one small fit each: a few minutes on 2 busy cores.
BENCHMARK_TIMEOUT_S = 900
pytestmark = pytest.mark.timeout(BENCHMARK_TIMEOUT_S + 120)


def test_step_benchmark_writes_every_metric_for_every_contender(tmp_path):
    log_path = tmp_path / "step.log"
    command = [sys.executable, "-m", "benchmarks.step", "--out", str(tmp_path), "--tiny", "--repeats", "1",
               "--name", "smoke", "--timeout", "600"]  # fmt: skip
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = process.wait(timeout=BENCHMARK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # SIGTERM stops its driver processes and its own Ray cluster (never the tests' Ray).
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
            pytest.fail(f"benchmarks.step ran over {BENCHMARK_TIMEOUT_S} s:\n{log_path.read_text()[-8000:]}")
    assert code == 0, log_path.read_text()[-8000:]

    document = json.loads((tmp_path / "smoke.json").read_text())
    markdown = (tmp_path / "smoke.md").read_text()
    check_every_metric(document, markdown, STEP_CONTENDERS, METRICS, BASELINE)
    for measurement in document["measurements"]:
        # The fit ran on every worker, with the steps asked for.
        assert measurement["fit"]["world_size"] == document["spec"]["workers"], measurement["contender"]
        assert measurement["fit"]["steps"] == document["spec"]["steps"], measurement["contender"]
    # Every RayStrategy contender is judged against every target, and the judgement is in the table.
    ours = [n for n in STEP_CONTENDERS if n != BASELINE]
    judged = {(t["contender"], t["target"]) for t in document["targets"] if t["status"] != "unknown"}
    assert judged == {(n, target) for n in ours for target, _, _ in TARGETS}
    assert all(t["target"] in markdown for t in document["targets"])
    # RayStrategy's own accounts: every rank's phases, and the start-up marks from fit to the first step.
    ray_runs = [m for m in document["measurements"] if m["contender"] == "ray"]
    assert ray_runs and sorted(ray_runs[0]["timings"]) == [str(r) for r in range(document["spec"]["workers"])]
    marks = [mark for mark, *_ in ray_runs[0]["startup"]]
    assert marks[0] == "fit called (driver)" and marks[-1] == "first step done", marks
    assert "Where each rank's step went" in markdown and "From `fit` to the first step" in markdown
    # The report's figures beside it: step time per contender, each rank's phases.
    assert (tmp_path / "smoke.png").stat().st_size > 1000 and (tmp_path / "smoke-phases.png").stat().st_size > 1000
