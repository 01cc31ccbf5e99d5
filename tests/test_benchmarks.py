"""Smoke test of the benchmark harness (benchmarks/): tiny sizes, every contender once.

It checks that the harness runs and writes every metric for every contender; it asserts no time,
ratio or target (those depend on the machine; see benchmarks/README.md for the real run). Except
``ray_no_watchdog``: the same fit as ``ray`` with one argument off, which the step benchmark's smoke
(tests/test_benchmarks_step.py) runs.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys

import pytest

from benchmarks.contenders import BASELINE, CONTENDERS
from benchmarks.report import BREAKDOWN, METRICS
from tests.conftest import ROOT

SMOKE_CONTENDERS = [name for name in CONTENDERS if name != "ray_no_watchdog"]
# Five contenders x two fits each (tiny sizes: the second fit brings the weights back), with Ray Train's slow start:
# minutes on 2 busy cores.
HARNESS_TIMEOUT_S = 1500
pytestmark = pytest.mark.timeout(HARNESS_TIMEOUT_S + 120)
# Where rank 0 is the driver itself, no weights travel back.
_ONLY_WHEN_WEIGHTS_TRAVEL = {"weights_back_s", "weights_speed_vs_copy"}


def _run_harness(out, *args: str) -> subprocess.CompletedProcess:
    """Run ``python -m benchmarks.run`` from the repository root; on a timeout it is stopped with SIGTERM,
    which tears down its driver processes and its Ray cluster, never the tests' own Ray."""
    command = [sys.executable, "-m", "benchmarks.run", "--out", str(out), *args]
    with open(out / "harness.log", "w+") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            process.wait(timeout=HARNESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
            log.seek(0)
            pytest.fail(f"benchmarks.run did not finish within {HARNESS_TIMEOUT_S} s:\n{log.read()[-8000:]}")
        log.seek(0)
        return subprocess.CompletedProcess(command, process.returncode, log.read())


def test_harness_writes_every_metric_for_every_contender(tmp_path):
    contenders = ",".join(SMOKE_CONTENDERS)
    result = _run_harness(
        tmp_path, "--tiny", "--repeats", "1", "--name", "smoke", "--timeout", "900", "--contenders", contenders
    )
    assert result.returncode == 0, result.stdout[-8000:]

    document = json.loads((tmp_path / "smoke.json").read_text())
    markdown = (tmp_path / "smoke.md").read_text()
    assert document["errors"] == []
    assert document["machine"]["cpus"] >= 1 and document["machine"]["ray"]
    assert list(document["table"]) == SMOKE_CONTENDERS
    assert len(document["measurements"]) == len(SMOKE_CONTENDERS)
    for name, entry in document["table"].items():
        contender = CONTENDERS[name]
        assert entry["repeats"] == 1
        assert entry["label"] in markdown
        # The driver's module holds the trained weights after the weights-back fit.
        assert entry["weights_returned"], name
        for metric in METRICS:
            summary = entry["metrics"][metric.key]
            if metric.key in _ONLY_WHEN_WEIGHTS_TRAVEL and contender.driver_is_rank_zero:
                assert summary is None, (name, metric.key)
                continue
            assert summary is not None, (name, metric.key)
            assert all(math.isfinite(v) and v > 0 for v in summary["samples"]), (name, metric.key, summary)
            assert summary["min"] <= summary["median"] <= summary["max"]
            assert math.isfinite(summary["ratio_vs_" + BASELINE]), (name, metric.key)
        for fit in ("fit1", "fit2"):
            for key in BREAKDOWN:
                assert all(math.isfinite(v) and v >= 0 for v in entry["breakdown"][fit][key]["samples"]), (name, key)
    for measurement in document["measurements"]:
        for fit in measurement["fits"].values():
            # Each fit ran on every worker, with the steps asked for.
            assert fit["world_size"] == document["spec"]["workers"], measurement["contender"]
        assert measurement["fits"]["fit1"]["steps"] == document["spec"]["steps"]
        assert measurement["weights_bytes"] >= 4 * document["spec"]["weights_params"]
    # Each ray_lightning contender is judged against every target, and the judgement is in the table.
    targets = document["targets"]
    assert {(t["contender"], t["status"] != "unknown") for t in targets} == {("ray", True), ("horovod_ray", True)}
    assert all(t["target"] in markdown for t in targets)
