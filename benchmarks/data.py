"""Ray Data into the training workers: samples per second with real CPU preprocessing, three ways.

    .venv/bin/python -m benchmarks.data        # from the repository root; see benchmarks/README.md

The same generated images, the same per-row preprocessing (benchmarks.data_rows.preprocess_row: a random
crop, a flip, the normalization and a blur, ~1.5 ms a row on one core), the same tiny model and 2 training
workers, fed by ray_lightning's RayDataModule under RayStrategy (the preprocessing a Ray Data map_batches), by
Ray Train (TorchTrainer(datasets=...), iter_torch_batches, RayDDPStrategy) and by a plain torch DataLoader
with loader processes in each RayStrategy worker. The harness of benchmarks.run: one local Ray cluster for the
whole run, offering the training workers' CPUs plus as many for the preprocessing as the DataLoader contender
has loader processes; round-robin over the contenders, each measurement a fresh driver process
(python -m benchmarks.data_driver). Writes ``<out>/<name>.json`` (every sample) and ``<out>/<name>.md`` and
prints the markdown.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial
from typing import Any

from benchmarks import options, run
from benchmarks.data_cpu import CPU_GROUPS
from benchmarks.data_driver import BASELINE, CONTENDERS, TinyConvNet
from benchmarks.data_restart import FRACTIONS
from benchmarks.data_rows import DataSpec, preprocess_row
from benchmarks.report import Metric, cell, failure_lines, metric_rows, per_contender, summarize

_SIZES = {
    "workers": "training processes per fit (default 2)",
    "rows": "rows of the one epoch of a fit (12288)",
    "batch_size": "rows per batch and worker (64)",
    "warmup": "steps left out of the throughput (10)",
    "work": "blur passes per row: its preprocessing cost (24)",
    "block_rows": "rows per block of the Ray Data pipeline (256)",
    "loader_workers": "DataLoader processes per worker, and Ray Data CPUs per worker (1)",
}
_CALIBRATION_ROWS = 300


def _check(args: argparse.Namespace, spec: DataSpec) -> str | None:
    spec.ready = args.ready
    if spec.warmup < 1 or spec.steps < spec.warmup + 2:
        return f"--rows gives {spec.steps} steps: need at least --warmup (>= 1) + 2"
    return None


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ready = {"action": "store_true", "help": "the data ready before each fit (the transport alone): the Ray Data "
             "pipeline materialized in the driver, the DataLoader's rows computed in each rank's setup"}  # fmt: skip
    return options.parse(
        argv, __doc__, "data", CONTENDERS, DataSpec, _SIZES, options=[("--ready", ready)], check=_check
    )


def calibrate(spec: DataSpec, threads: int) -> dict[str, float]:
    """In this process, one thread as each training worker has: the preprocessing of one row, and a training
    step of the model on one batch (forward, backward, SGD), medians in ms. What the contenders' pipelines add
    is measured against these."""
    import numpy as np
    import torch
    from torch.nn import functional as F

    torch.set_num_threads(threads)
    rows = 20 if spec.rows < _CALIBRATION_ROWS else _CALIBRATION_ROWS
    row_s = []
    for i in range(rows):
        start = time.perf_counter()
        preprocess_row(i, spec)
        row_s.append(time.perf_counter() - start)
    model = TinyConvNet(spec)
    optimizer = model.configure_optimizers()
    x = torch.from_numpy(np.stack([preprocess_row(i, spec) for i in range(spec.batch_size)]))
    y = torch.arange(spec.batch_size) % spec.classes
    step_s = []
    for _ in range(20):
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        step_s.append(time.perf_counter() - start)
    row_ms = statistics.median(row_s) * 1000
    cpus = os.cpu_count() or 1
    return {
        "row_ms": row_ms,
        "model_step_ms": statistics.median(step_s[5:]) * 1000,
        # Every core preprocessing and nothing else: the most samples/s this machine could give.
        "preprocessing_bound_samples_per_s": cpus / row_ms * 1000,
    }


def cluster_cpus(spec: DataSpec) -> int:
    """The Ray cluster's CPUs: one per training worker, and ``loader_workers`` per worker for the preprocessing
    (Ray Data's tasks; the training workers' CPUs are reserved for them)."""
    return spec.workers * (1 + spec.loader_workers)


# -- The tables: The data benchmark's tables: samples/s, idle time per step and fit time per contender, ratios against
# Ray Train, where the node's CPU went, and the goal.
RESTART_METRICS = (
    Metric("restart_s", "kill → 1st batch of the new attempt, s", ".2f"),
    Metric("workers_s", "kill → the new attempt's on_fit_start, s", ".2f"),
    Metric("data_s", "on_fit_start → 1st batch, s", ".2f"),
    Metric("kill_step", "at step", ".0f"),
)
METRICS = (
    Metric("epoch_samples_per_s", "samples/s, epoch", ".0f"),
    Metric("samples_per_s", "samples/s, steady", ".0f"),
    Metric("idle_epoch_ms", "idle per step, ms, epoch", ".1f"),
    Metric("idle_ms", "idle per step, ms, steady (median)", ".1f"),
    Metric("idle_mean_ms", "idle per step, ms, steady (mean)", ".1f"),
    Metric("step_ms", "step, ms (median)", ".1f"),
    Metric("setup_s", "on_fit_start → 1st batch, s", ".1f"),
    Metric("first_batch_s", "fit → 1st batch, s", ".1f"),
    Metric("fit_s", "fit, s", ".1f"),
)
# The metrics shown with a ratio of medians against Ray Train's.
RATIOS = ("epoch_samples_per_s", "samples_per_s", "idle_epoch_ms", "idle_mean_ms", "fit_s")
# The contenders whose throughput is judged against the goals.
JUDGED = ("ray_data", "ray_data_ordered")


def build(results: list[dict[str, Any]], order: list[str]) -> dict[str, Any]:
    """Per contender and metric: samples, median, spread; the CPU per sample of each group of processes; ratios
    of medians against Ray Train's. The restart and resume contenders: their times (:data:`RESTART_METRICS`)."""

    def built(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
        entry: dict[str, Any] = {"label": CONTENDERS[name].label, "note": CONTENDERS[name].note, "repeats": len(runs)}
        if name in FRACTIONS:
            entry["metrics"] = {m.key: summarize([r["metrics"].get(m.key) for r in runs]) for m in RESTART_METRICS}
            return entry
        cpus = [r["cpu"] for r in runs if r["cpu"]]
        return {
            **entry,
            "metrics": {m.key: summarize([r["metrics"].get(m.key) for r in runs]) for m in METRICS},
            "cpu_ms_per_sample": {g: summarize([c["cpu_ms_per_sample"][g] for c in cpus]) for g in CPU_GROUPS},
            "cores": {g: summarize([c["cores"][g] for c in cpus]) for g in CPU_GROUPS},
            "node_cores": summarize([c["node_cores"] for c in cpus]),
            "machine_cores": summarize([c["machine_cores"] for c in cpus]),
            "other_cores": summarize([c["other_cores"] for c in cpus]),
            "coordinating_s_per_gb": summarize([c.get("coordinating_s_per_gb") for c in cpus]),
            "first_batch": runs[0]["first_batch"],
        }

    table = per_contender(results, order, built)
    base = table.get(BASELINE)
    for name, entry in table.items():
        if name in FRACTIONS:
            continue
        for key in RATIOS:
            ours, theirs = entry["metrics"][key], base["metrics"][key] if base else None
            if ours is not None and theirs is not None and theirs["median"] and name != BASELINE:
                ours["ratio"] = ours["median"] / theirs["median"]
    return table


def _median(table: dict[str, Any], name: str, *path: str) -> float | None:
    found: Any = table.get(name)
    for key in path:
        found = found.get(key) if isinstance(found, dict) else None
    return found["median"] if isinstance(found, dict) and "median" in found else None


def _goal(goal: str, contender: str, value: float | None, bound: float, at_most: bool = False) -> dict[str, Any]:
    status = "unknown" if value is None else "met" if (value <= bound if at_most else value >= bound) else "missed"
    return {"goal": goal, "contender": contender, "value": value, "bound": bound, "status": status}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def goals(table: dict[str, Any], ready: bool = False) -> list[dict[str, Any]]:
    """The data path's goals (issue 35), each met, missed or unknown (a contender did not run): with the data
    ready (``--ready``) the steady throughput against Ray Train's and a DataLoader's, else the epoch's with the
    preprocessing; the first batch and the coordinating process's CPU per GB against Ray Train's; a restart at 90%
    of the epoch against one at 10%."""
    rows = []
    for name in (n for n in JUDGED if n in table):
        if ready:
            ours = _median(table, name, "metrics", "samples_per_s")
            rows.append(
                _goal(
                    "samples/s (steady, data ready) at least Ray Train's",
                    name,
                    _ratio(ours, _median(table, BASELINE, "metrics", "samples_per_s")),
                    1.0,
                )
            )
            rows.append(
                _goal(
                    "samples/s (steady, data ready) within 20% of a DataLoader's",
                    name,
                    _ratio(ours, _median(table, "torch_loader", "metrics", "samples_per_s")),
                    0.8,
                )
            )
        else:
            rows.append(
                _goal(
                    "samples/s (epoch, preprocessing) at least 1.2x Ray Train's",
                    name,
                    _ratio(
                        _median(table, name, "metrics", "epoch_samples_per_s"),
                        _median(table, BASELINE, "metrics", "epoch_samples_per_s"),
                    ),
                    1.2,
                )
            )
    rows.append(
        _goal(
            "on_fit_start → 1st batch (default shuffle) at most Ray Train's, ratio",
            "ray_data",
            _ratio(_median(table, "ray_data", "metrics", "setup_s"), _median(table, BASELINE, "metrics", "setup_s")),
            1.0,
            at_most=True,
        )
    )
    rows.append(
        _goal(
            "coordinating process CPU s per GB at most 2x Ray Data's SplitCoordinator's",
            "ray_data",
            _ratio(
                _median(table, "ray_data", "coordinating_s_per_gb"), _median(table, BASELINE, "coordinating_s_per_gb")
            ),
            2.0,
            at_most=True,
        )
    )
    # The whole restart, and the data's part of it (the new attempt's on_fit_start → its first batch): the workers'
    # restart before it does not depend on the position, but competes for the CPUs with a pipeline still running.
    for key, what in (("restart_s", "kill → 1st batch"), ("data_s", "the data's part (on_fit_start → 1st batch)")):
        found = [_median(table, n, "metrics", key) for n in ("restart_at_10", "restart_at_90")]
        spread = max(found) / min(found) if None not in found and min(found) else None  # type: ignore[type-var]
        rows.append(_goal(f"restart at 90% within 20% of at 10%, {what}: larger / smaller", "restart_at_*",
                          spread, 1.2, at_most=True))  # fmt: skip
    return rows


def _header(document: dict[str, Any]) -> list[str]:
    spec, machine, calibration = document["spec"], document["machine"], document["calibration"]
    preprocessing = spec["workers"] * spec["loader_workers"]
    load = document["load_average"]
    return [
        f"{spec['workers']} training workers, {machine['threads_per_process']} torch thread(s) each; one epoch of "
        f"{spec['rows']} rows ({document['steps']} steps of {spec['batch_size']} rows per worker; throughput, idle "
        f"and step over the steps after the first {spec['warmup']}). A row: a generated uint8 image "
        f"{spec['channels']}x{spec['image']}x{spec['image']}, random crop to {spec['crop']}x{spec['crop']}, flip, "
        f"normalize, {spec['work']} blur passes: {calibration['row_ms']:.2f} ms on one core (so at most "
        f"{calibration['preprocessing_bound_samples_per_s']:.0f} samples/s if every core did nothing else); the "
        f"model (conv 3→8, pool, linear) trains on a batch in {calibration['model_step_ms']:.1f} ms. Ray cluster: "
        f"{document['cluster_cpus']} CPUs ({spec['workers']} for the workers, {preprocessing} for the preprocessing; "
        f"the DataLoader has {spec['loader_workers']} process(es) per worker). "
        f"{document['repeats']} repeat(s), each a fresh driver process, round-robin."
        + (
            " **Data ready** (`--ready`): the pipeline materialized in the driver before each fit, the "
            "DataLoader's rows computed in each rank's `setup`: what is measured is the transport alone."
            if spec.get("ready")
            else ""
        ),
        f"Machine: {machine['cpus']} CPUs, {machine['memory_gb']:.0f} GB; torch {machine['torch']}, "
        f"Lightning {machine['pytorch_lightning']}, Ray {machine['ray']}; load average (1 min) "
        f"{load['before'][0]:.1f} before the run, {load['after'][0]:.1f} after.",
    ]


def _main_lines(table: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"Cells: median (min–max) ×ratio of medians against Ray Train's (`{BASELINE}`). All from rank 0's clock. "
        "*Epoch*: from rank 0's `on_fit_start` (every pipeline starts reading after it: its ramp-up counts, the "
        "workers' launch does not) to its last step's end. *Steady*: from the end of the warm-up steps to the "
        "last step's end; a pipeline that preprocessed ahead during the ramp-up serves that window from memory. "
        "samples/s: both workers' rows. Idle: the gap between rank 0's `on_train_batch_end` and its next "
        "`on_train_batch_start`, where Lightning fetches the next batch; *epoch*: all of the epoch that was not "
        "a step, over the steps (the wait for the first batch included). Step: `on_train_batch_start` → "
        "`on_train_batch_end` (forward, backward with DDP's all-reduce, SGD). fit: the driver's `fit()` call, "
        "Ray already initialized.",
        "",
        *metric_rows(_throughput(table), METRICS, "ratio", named=True),
    ]
    notes = [f"- `{name}`: {entry['note']}." for name, entry in _throughput(table).items() if entry["note"]]
    return lines + (["", *notes] if notes else [])


def _throughput(table: dict[str, Any]) -> dict[str, Any]:
    return {name: entry for name, entry in table.items() if name not in FRACTIONS}


def _restart_lines(table: dict[str, Any]) -> list[str]:
    found = {name: entry for name, entry in table.items() if name in FRACTIONS}
    if not found:
        return []
    lines = [
        "",
        "Restarts (`RayStrategy(max_failures=1, recovery_checkpoint_every_n_steps=1)`, rank 1 SIGKILLed at the "
        "step's start; the coordinator serves the resumed epoch from the windows it kept) and resumes (a new "
        "`fit(ckpt_path=...)`: a new coordinator, the pipeline runs again up to the checkpoint, trained blocks "
        "dropped unread). Medians (min–max).",
        "",
        *metric_rows(found, RESTART_METRICS, "", named=True),
    ]
    return lines


def _cpu_lines(table: dict[str, Any]) -> list[str]:
    table = _throughput(table)
    groups = [g for g in CPU_GROUPS if any(e["cpu_ms_per_sample"][g] for e in table.values())]
    if not groups:
        return []
    lines = [
        "",
        "Where the CPU went over the steady window: CPU ms per sample of each group of the Ray node's processes "
        "(the raylet and its descendants, from `/proc`, medians), the node's and the whole machine's busy cores; "
        "machine − node: the driver, the GCS and any other work on the machine (~0.1 when the benchmark has the "
        "machine to itself: more means the run shared it).",
        "",
        "| contender | " + " | ".join(CPU_GROUPS[g] for g in groups) + " | all, ms/sample | node, cores | "
        "machine, cores | machine − node, cores | coordinating process, CPU s per GB |",
        "| --- |" + " ---: |" * (len(groups) + 5),
    ]
    for name, entry in table.items():
        per_sample = entry["cpu_ms_per_sample"]
        total = sum(per_sample[g]["median"] for g in groups if per_sample[g])
        cells = [cell(per_sample[g], ".2f", "") for g in groups]
        cells += [f"{total:.2f}"] + [cell(entry[k], ".2f", "") for k in ("node_cores", "machine_cores", "other_cores")]
        cells.append(cell(entry["coordinating_s_per_gb"], ".3f", ""))
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return lines


def _goal_lines(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = ["", "| goal (reported, not asserted) | contender | ratio | bound | status |",
             "| --- | --- | ---: | ---: | --- |"]  # fmt: skip
    for row in rows:
        value = "n/a" if row["value"] is None else f"{row['value']:.3f}"
        lines.append(f"| {row['goal']} | `{row['contender']}` | {value} | {row['bound']:g} | {row['status']} |")
    return lines


def markdown(document: dict[str, Any]) -> str:
    """The tables as markdown, to print and to paste into benchmarks/README.md."""
    table = document["table"]
    lines = _header(document) + _main_lines(table) + _cpu_lines(table) + _restart_lines(table)
    lines += _goal_lines(document["goals"])
    return "\n".join(lines + failure_lines(document)) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    spec, started = args.spec, time.time()
    calibration = calibrate(spec, run._threads_per_process(spec.workers))
    load = os.getloadavg()

    def judge(results: list, errors: list) -> dict[str, Any]:
        table = build(results, args.contenders.split(","))
        return {
            "steps": spec.steps,
            "cluster_cpus": cluster_cpus(spec),
            "calibration": calibration,
            # The machine's 1-, 5- and 15-minute load averages before and after: whether other work shared it.
            "load_average": {"before": load, "after": os.getloadavg()},
            "table": table,
            "goals": goals(table, spec.ready),
        }

    measure = partial(run._measure_all, args, spec, entry="benchmarks.data_driver", num_cpus=cluster_cpus(spec))
    return run.benchmark(args, argv, "data", measure, judge, markdown, started=started)


if __name__ == "__main__":
    run.entry(main)
