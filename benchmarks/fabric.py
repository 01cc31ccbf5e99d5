"""The Fabric benchmark: ``Fabric(strategy=RayStrategy(...))`` against Fabric's own ``ddp_spawn``, the same loop.

    .venv/bin/python -m benchmarks.fabric          # from the repository root; see benchmarks/README.md

The harness of :mod:`benchmarks.run`: one local Ray cluster owned by this process, the same threads per
process, round-robin over the contenders, each measurement a fresh driver process
(:mod:`benchmarks.fabric_measure`) that runs ``fabric.launch`` twice: the first launch, and a second with a new
Fabric of the same strategy (RayStrategy's warm workers). The loop and its sizes: :mod:`benchmarks.fabric_workload`.
A thread of this process samples the machine's other load (:mod:`benchmarks.fabric_load`) so a busy machine
shows in the table. Writes ``<out>/<name>.json`` (every sample) and ``<out>/<name>.md``
(:mod:`benchmarks.fabric`) and prints the markdown.
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

from benchmarks import options, run
from benchmarks.fabric_measure import BASELINE, CONTENDERS, LAUNCHES
from benchmarks.fabric_workload import FabricSpec
from benchmarks.report import (
    Metric,
    add_ratios,
    cell,
    failure_lines,
    metric_rows,
    per_contender,
    ratio_target_lines,
    ratio_targets,
    scaled,
    summaries,
)

_SIZES = {
    "workers": "training processes per launch (2)",
    "steps": "optimizer steps per launch (300)",
    "warmup": "steps left out of the step time (30)",
    "batch_size": "per worker (128)",
    "hidden": "width of the MLP's hidden layers (384)",
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    return options.parse(argv, __doc__, "fabric", CONTENDERS, FabricSpec, _SIZES)


def other_load(result: dict[str, Any], load: Any) -> None:
    """The machine's other load during a measurement, among its metrics (Fabric's and Tune's drivers)."""
    result["metrics"]["other_load_cores"] = load.cores(*result["window"])


# -- The tables: The Fabric benchmark's tables: every metric's samples, median and spread, ratios against Fabric's
# ``ddp_spawn``, the goals judged, and the markdown.
METRICS = (
    Metric("first_step_s", "launch → 1st step, s", ".2f"),
    Metric("step_ms", "step, ms", ".2f"),
    Metric("step_cpu_ms", "step CPU, ms", ".2f"),
    Metric("launch2_first_step_s", "2nd launch → 1st step, s", ".2f"),
    Metric("launch_s", "launch call, s", ".2f"),
    Metric("launch2_s", "2nd launch call, s", ".2f"),
    Metric("other_load_cores", "machine's other load, cores", ".2f"),
)
# Where the time of each launch goes (medians; see `benchmarks.measure._fit_metrics`): s, but the step in ms.
BREAKDOWN = (
    Metric("process_s", "process", ".2f"),
    Metric("process_to_function_s", "→ function", ".2f"),
    Metric("startup_cpu_s", "its CPU", ".2f"),
    Metric("launch_s", "start", ".2f"),
    Metric("setup_s", "setup", ".2f"),
    Metric("first_step_s", "→ 1st step", ".2f"),
    Metric("return_s", "return", ".2f"),
    Metric("step_s", "step, ms", ".2f"),
)
# (the goal, the metric, check(ratio of medians against ddp_spawn)); the issue's: "step within 2% of Fabric's own,
# launch faster than its ddp_spawn". A launch is judged to its first step: the steps after it are the step goal's.
TARGETS = (
    ("steady-state step within 2% of Fabric's ddp_spawn", "step_ms", lambda ratio: ratio <= 1.02),
    ("1st launch reaches its 1st step faster than ddp_spawn", "first_step_s", lambda ratio: ratio < 1.0),
    ("2nd launch reaches its 1st step faster than ddp_spawn", "launch2_first_step_s", lambda ratio: ratio < 1.0),
)
_RATIO = "ratio_vs_" + BASELINE


def build(results: list[dict[str, Any]], order: list[str]) -> dict[str, Any]:
    """Per contender: each metric's samples, median, spread and ratio of medians against ddp_spawn; the breakdown."""

    def entry(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
        breakdown = {launch: summaries([r["launches"][launch] for r in runs], BREAKDOWN, None) for launch in LAUNCHES}
        return {"label": CONTENDERS[name].label, "repeats": len(runs), "metrics": summaries(runs, METRICS),
                "breakdown": breakdown}  # fmt: skip

    return add_ratios(per_contender(results, order, entry), BASELINE, skip=("other_load_cores",))


def targets(table: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal for every contender but ddp_spawn: met, missed, or unknown (no ddp_spawn run)."""
    return ratio_targets(table, BASELINE, TARGETS)


def _breakdown_titles() -> list[str]:
    """The breakdown's column titles: each launch's first column names it ("1st launch: start")."""
    return [f"{launch} launch: {m.title}" if i == 0 else m.title for launch in ("1st", "2nd") for i, m in
            enumerate(BREAKDOWN)]  # fmt: skip


def markdown(document: dict[str, Any]) -> str:
    spec, machine, table, load = document["spec"], document["machine"], document["table"], document["load"]
    lines = [
        f"{spec['workers']} workers, two `fabric.launch` of {spec['steps']} steps each per driver process (step: "
        f"median after {spec['warmup']}), batch {spec['batch_size']}, MLP {spec['features']}-{spec['hidden']}-"
        f"{spec['hidden']}-{spec['classes']}, SGD; {document['repeats']} repeat(s). Machine: {machine['cpus']} "
        f"CPUs; torch {machine['torch']}, Lightning {machine['pytorch_lightning']}, Ray {machine['ray']}; "
        f"{machine['threads_per_process']} torch thread(s) per process. Load average before the run: "
        f"{load['loadavg_before'][0]:.2f} (1 min); the machine's other load over the run: "
        + ("n/a" if load["other_cores"] is None else f"{load['other_cores']:.2f} cores")
        + ".",
        "",
        f"Cells: median (min–max) ×ratio of medians against {BASELINE}. launch → 1st step = `fabric.launch` called "
        "→ rank 0's first batch's forward and backward done; step = rank 0's steady-state step (after "
        "`optimizer.step()`), step CPU = its process's CPU time per step; 2nd launch = a new Fabric of the same "
        "strategy in the same driver process; launch call = `fabric.launch` called → returned (the steps "
        "included); machine's other load = busy cores outside the benchmark's processes during the measurement.",
        "",
        *metric_rows(table, METRICS, _RATIO),
        "",
        "Where each launch's time goes (medians, s): process = `fabric.launch` called → rank 0's process created "
        "(negative: it was there before the call, a worker Ray started ahead or one the last launch left warm); → "
        "function = from the later of the two to its function's start (Python, imports, the worker's setup, the "
        "process group); its CPU = the CPU rank 0's process had spent by then (n/a: it trained in the last launch); "
        "start = "
        "`fabric.launch` called → rank 0's function starts (the two before together); setup = → its first batch "
        "(`fabric.setup`, "
        "`setup_dataloaders`); → 1st step = the same as above, from the call; return = rank 0's function returned "
        "→ `launch` returned; step in ms.",
        "",
        "| contender | " + " | ".join(_breakdown_titles()) + " |",
        "| --- |" + " ---: |" * len(LAUNCHES) * len(BREAKDOWN),
    ]
    for entry in table.values():
        cells = [
            cell(scaled(entry["breakdown"][launch][m.key], 1000 if m.key == "step_s" else 1), m.fmt)
            for launch in LAUNCHES
            for m in BREAKDOWN
        ]
        lines.append(f"| {entry['label']} | " + " | ".join(cells) + " |")
    lines += ratio_target_lines(document["targets"], CONTENDERS, "against", f" ({BASELINE})")
    return "\n".join(lines + failure_lines(document)) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    judge = run.tables(args, build, targets)
    measure = partial(run._measure_all, args, args.spec, entry="benchmarks.fabric_measure")
    return run.benchmark(args, argv, "fabric", measure, judge, markdown, other_load=other_load)


if __name__ == "__main__":
    run.entry(main)
