"""Smoke test of the restart benchmark (benchmarks/recovery.py): tiny sizes, each code path once.

It checks that a worker was killed and every fit still finished, and that every metric is there and
finite; it asserts no time, ratio or goal (those depend on the machine; see benchmarks/README.md).

Left out are the cases that differ from one here only in ``recovery_checkpoint_every_n_steps`` (``ray_n``,
``ray_train_n``, ``ray_mf1_n``): RayStrategy's step cadence is tested in tests/test_restarts.py, and each of
those is a minute of a 2-core machine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.recovery import METRICS, PERCENT_KEYS
from benchmarks.recovery_driver import CASES
from tests.benchmark_runs import run_benchmark

SMOKE_CASES = ("ray", "ray_ckpt", "ray_train", "ray_mf0", "ray_mf1", "fsdp_mf0", "fsdp_mf1")

# Seven fits, one of them Ray Train's (a controller and worker group per start, twice): minutes on 2 busy cores.
BENCHMARK_TIMEOUT_S = 1200
pytestmark = pytest.mark.timeout(BENCHMARK_TIMEOUT_S + 120)
# Only RayStrategy reports when its driver learned of the failure.
_RAY_LIGHTNING_ONLY = {"detect_s"}


def _run_benchmark(out: Path, *args: str) -> tuple[int, str]:
    return run_benchmark("recovery", out, BENCHMARK_TIMEOUT_S, *args)


def _finite(summary: dict | None, where: tuple) -> None:
    assert summary is not None, where
    assert all(math.isfinite(v) for v in summary["samples"]), (where, summary)
    assert summary["min"] <= summary["median"] <= summary["max"], where


def test_restart_benchmark_writes_every_metric_and_every_fit_finishes(tmp_path):
    code, output = _run_benchmark(
        tmp_path, "--tiny", "--repeats", "1", "--name", "smoke", "--timeout", "600", "--contenders",
        ",".join(SMOKE_CASES),
    )  # fmt: skip
    assert code == 0, output[-8000:]

    document = json.loads((tmp_path / "smoke.json").read_text())
    markdown = (tmp_path / "smoke.md").read_text()
    assert document["errors"] == []
    assert list(document["table"]) == list(SMOKE_CASES)
    for name, entry in document["table"].items():
        case = CASES[name]
        assert entry["repeats"] == 1 and entry["finished"], (name, entry)
        assert entry["label"] in markdown
        for metric in METRICS[case.part]:
            if metric.key in _RAY_LIGHTNING_ONLY and case.ray_train:
                assert entry["metrics"][metric.key] is None, (name, metric.key)
                continue
            _finite(entry["metrics"][metric.key], (name, metric.key))
        if case.against:  # RayStrategy against Ray Train with the same checkpoints
            assert math.isfinite(entry["metrics"]["recovery_s"]["ratio"]), name
        if case.baseline:  # max_failures=1 against the same strategy's max_failures=0 (fsdp_ against fsdp_mf0)
            for key in PERCENT_KEYS:
                summary, base = entry["metrics"][key], document["table"][case.baseline]["metrics"][key]
                assert math.isfinite(summary["percent"]), (name, key)
                assert math.isclose(summary["percent"], (summary["median"] / base["median"] - 1) * 100), (name, key)
    spec = document["spec"]
    for run in document["measurements"]:
        metrics = run["metrics"]
        if CASES[run["contender"]].part == "recovery":
            # Killed once after the planned step, restarted once: RayStrategy from the survivor's memory at that
            # step (unless told not to), the others from a checkpoint before it.
            assert metrics["kill_step"] == spec["kill_step"] and metrics["attempts"] == 2, run
            case = CASES[run["contender"]]
            if case.from_memory and not case.ray_train:
                assert metrics["work_lost_steps"] == 0 and metrics["resumed_step"] == spec["kill_step"], run
            else:
                assert 0 < metrics["work_lost_steps"] <= spec["kill_step"], run
        assert metrics["final_global_step"] > 0, run
    # Every goal is judged, and the judgement is in the tables.
    assert {t["case"] for t in document["targets"]} == {"ray", "ray_mf1", "fsdp_mf1"}
    assert all(t["status"] != "unknown" for t in document["targets"])
    assert all(t["target"] in markdown for t in document["targets"])
