"""Smoke test of the Ray Data benchmark (benchmarks/data.py): tiny sizes, once, the three ways to feed the workers.

It checks that every contender trained the whole epoch on every worker with the same batches, and that every
metric is there and finite, samples/s positive, the CPU breakdown taken and the goal judged; it asserts no time,
ratio or goal's outcome (those depend on the machine; see benchmarks/README.md for the real run).
`ray_data_ordered` is left out: it is `ray_data` with `shuffle=None`, the same code path here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.data import METRICS
from benchmarks.data_cpu import CPU_GROUPS
from tests.benchmark_runs import run_benchmark

SMOKE_CONTENDERS = ("ray_data", "ray_train", "torch_loader", "restart_at_10")
THROUGHPUT = SMOKE_CONTENDERS[:3]
# Three driver processes of one small fit each (Ray Train's starts a controller and a worker group): 1-2 minutes
# on 2 quiet cores, more on busy ones.
BENCHMARK_TIMEOUT_S = 900
pytestmark = pytest.mark.timeout(BENCHMARK_TIMEOUT_S + 120)


def _run_benchmark(out: Path, *args: str) -> tuple[int, str]:
    return run_benchmark("data", out, BENCHMARK_TIMEOUT_S, *args)


def test_data_benchmark_measures_every_contender(tmp_path):
    code, output = _run_benchmark(
        tmp_path, "--tiny", "--repeats", "1", "--name", "smoke", "--timeout", "600", "--contenders",
        ",".join(SMOKE_CONTENDERS),
    )  # fmt: skip
    assert code == 0, output[-8000:]

    document = json.loads((tmp_path / "smoke.json").read_text())
    markdown = (tmp_path / "smoke.md").read_text()
    assert document["errors"] == []
    table = document["table"]
    assert list(table) == list(SMOKE_CONTENDERS)
    restart = table.pop("restart_at_10")["metrics"]
    # The restart: the kill, the new attempt's start, its first batch, in that order.
    assert 0 < restart["workers_s"]["median"] <= restart["restart_s"]["median"], restart
    assert restart["kill_step"]["median"] >= 1
    for name, entry in table.items():
        assert entry["repeats"] == 1 and entry["label"] in markdown, name
        for metric in METRICS:
            summary = entry["metrics"][metric.key]
            assert summary is not None, (name, metric.key)
            assert all(math.isfinite(v) and v >= 0 for v in summary["samples"]), (name, metric.key, summary)
        for key in ("epoch_samples_per_s", "samples_per_s"):
            assert entry["metrics"][key]["median"] > 0, (name, key)
            # Ratios against Ray Train's, measured in the same run.
            assert name == "ray_train" or math.isfinite(entry["metrics"][key]["ratio"]), (name, key)
        # The CPU of the Ray node over the steady window: the training workers' is always there.
        assert entry["cpu_ms_per_sample"]["ranks"]["median"] > 0, (name, entry["cpu_ms_per_sample"])
        assert set(entry["cpu_ms_per_sample"]) == set(CPU_GROUPS)
        assert entry["machine_cores"]["median"] > 0, name

    spec = document["spec"]
    crop = spec["crop"]
    batch = {"image": [[spec["batch_size"], spec["channels"], crop, crop], "torch.float32"],
             "label": [[spec["batch_size"]], "torch.int64"]}  # fmt: skip
    for run in (r for r in document["measurements"] if r["contender"] in THROUGHPUT):
        name = run["contender"]
        # Every contender trained the whole epoch on every worker, with the same batches.
        assert run["world_size"] == spec["workers"] and run["steps"] == document["steps"], name
        assert set(run["ranks"]) == {str(r) for r in range(spec["workers"])}, name
        assert all(first == batch for first in run["first_batch"].values()), (name, run["first_batch"])
        assert run["cpu"] is not None, name
    # Ray Train's coordinating process (its SplitCoordinator) and ours are found and measured per GB (at tiny sizes
    # either can use less CPU in the window than the clock's 10 ms tick: measured as 0).
    for name, group in (("ray_train", "split_coordinator"), ("ray_data", "coordinator")):
        run = next(r for r in document["measurements"] if r["contender"] == name)
        assert group in run["cpu"]["found"], (name, run["cpu"])
        assert table[name]["coordinating_s_per_gb"]["median"] >= 0, (name, table[name]["cpu_ms_per_sample"])
    # The goals are judged where their contenders ran (not the restart spread: one restart ran), and are in the tables.
    judged = {g["goal"].split(" ")[0]: g["status"] for g in document["goals"] if g["contender"] == "ray_data"}
    assert judged["samples/s"] in ("met", "missed") and judged["on_fit_start"] in ("met", "missed"), document["goals"]
    assert all(g["goal"] in markdown for g in document["goals"])
    assert (tmp_path / "smoke.png").stat().st_size > 1000, "the report's figure: samples/s per contender"
