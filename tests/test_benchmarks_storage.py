"""Smoke test of the storage benchmark (benchmarks/storage.py): tiny sizes, once, against its own S3 server.

It checks that every case ran (the resume case: its first driver killed once a checkpoint was complete in the
bucket, the second resumed from it), that every metric is there and finite and every goal judged; it asserts
no time, ratio or goal's outcome (those depend on the machine; see benchmarks/README.md).

The cases: one of each code path, to stay near 3 minutes on 2 cores. Left out are the ones that differ from a
case here only in an argument: the FSDP cost cases (RayFSDPStrategy's uploads run in mem_storage, cold_start
and resume; the timing and the synchronous wait in the DDP cost cases) and Ray Train's synchronous upload mode.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.storage_driver import CASES
from benchmarks.storage_report import METRICS
from tests.benchmark_runs import run_benchmark

SMOKE_CASES = (
    "mem_none",
    "mem_driver",
    "mem_storage",
    "cost_ddp_none",
    "cost_ddp_sync",
    "cost_ddp_async",
    "ray_train_async",
    "cold_start",
    "resume",
)
# Ten driver processes (Ray Train's starts a controller and a worker group) on 2 busy cores: minutes.
BENCHMARK_TIMEOUT_S = 1200
pytestmark = pytest.mark.timeout(BENCHMARK_TIMEOUT_S + 120)

# Metrics that a case has no value for, by design.
_REFERENCE_CASES = {"mem_none", "cost_ddp_none", "cost_fsdp_none"}
_NONE_FOR = {
    # The references: nothing is added over themselves, and they take no checkpoints.
    "mem_none": {"rank0_added_mb", "rank1_added_mb", "checkpoint_mb"},
    "cost_ddp_none": {
        "checkpoint_mb",
        "blocked_s",
        "first_blocked_s",
        "blocked_share_pct",
        "upload_wait_s",
        "added_per_checkpoint_s",
        "server_cpu_per_checkpoint_s",
    },  # fmt: skip
    # A synchronous save has nothing in flight to wait for; Ray Train's uploads are not ray_lightning's.
    "cost_ddp_sync": {"upload_wait_s"},
    "ray_train_async": {"upload_wait_s"},
    # A cold start was not killed.
    "cold_start": {"kill_first_step_s"},
}


def _run_benchmark(out: Path, *args: str) -> tuple[int, str]:
    return run_benchmark("storage", out, BENCHMARK_TIMEOUT_S, *args)


def _finite(summary: dict | None, where: tuple) -> None:
    assert summary is not None, where
    assert summary["samples"] and all(math.isfinite(v) for v in summary["samples"]), (where, summary)
    assert summary["min"] <= summary["median"] <= summary["max"], where


def test_storage_benchmark_writes_every_metric_and_the_killed_run_resumes(tmp_path):
    code, output = _run_benchmark(
        tmp_path, "--tiny", "--repeats", "1", "--name", "smoke", "--timeout", "600", "--contenders",
        ",".join(SMOKE_CASES),
    )  # fmt: skip
    assert code == 0, output[-8000:]

    document = json.loads((tmp_path / "smoke.json").read_text())
    markdown = (tmp_path / "smoke.md").read_text()
    assert document["errors"] == []
    table = document["table"]
    assert list(table) == list(SMOKE_CASES)
    for name, entry in table.items():
        case = CASES[name]
        assert entry["repeats"] == 1 and entry["label"] in markdown, name
        for metric in METRICS[case.part]:
            summary = entry["metrics"][metric.key]
            if metric.key in _NONE_FOR.get(name, ()):
                assert summary is None, (name, metric.key)
                continue
            _finite(summary, (name, metric.key))
    # Ratios against the references measured in the same run.
    assert math.isfinite(table["mem_storage"]["metrics"]["driver_peak_rss_mb"]["ratio"])
    assert math.isfinite(table["cost_ddp_async"]["metrics"]["blocked_s"]["ratio"])
    assert math.isfinite(table["cost_ddp_async"]["metrics"]["mean_step_ms"]["percent"])
    assert math.isfinite(table["resume"]["metrics"]["start_first_step_s"]["ratio"])

    spec = document["spec"]
    per_epoch, epochs = spec["cost_steps"], spec["cost_epochs"]
    for run in document["measurements"]:
        name, metrics = run["contender"], run["metrics"]
        part = CASES[name].part
        total = spec["steps"] * spec["epochs"] if part == "memory" else per_epoch * epochs
        assert metrics["final_global_step"] == total, (name, metrics)
        if part == "cost" and name not in _REFERENCE_CASES:
            assert metrics["checkpoints"] == epochs, (name, metrics)  # one at every epoch end, each timed
        if name == "resume":
            # The first driver was killed after a checkpoint was complete; the second resumed from it.
            assert run["killed"]["marker"]["global_step"] == per_epoch, run["killed"]
            assert metrics["resumed_step"] == per_epoch, metrics
        if name == "cold_start":
            assert metrics["resumed_step"] == 0, metrics
        if part != "cost" or name not in _REFERENCE_CASES:
            # Where checkpoints went to the bucket, the newest is there (and was removed with the run after).
            stored = run["stored"]["files"]
            assert stored > 0 if CASES[name].storage or CASES[name].ray_train else stored == 0, (name, run["stored"])
    # Every goal is judged for every case it is about, and the judgement is in the tables.
    judged = {(g["goal"], g["case"]) for g in document["goals"]}
    assert {case for _, case in judged} == {"mem_storage", "mem_driver", "cost_ddp_async"}
    # Unknown only where tiny sizes leave nothing to divide by (checkpoints added no memory to rank 1).
    assert all(g["status"] in ("met", "missed") for g in document["goals"] if "add" not in g["goal"]), document
    assert all(g["status"] in ("met", "missed", "unknown") for g in document["goals"])
    assert all(g["goal"] in markdown for g in document["goals"])
