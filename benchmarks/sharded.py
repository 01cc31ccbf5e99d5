"""The sharded-training benchmark: RayFSDPStrategy against Lightning's own sharded training (issue 15).

    .venv/bin/python -m benchmarks.sharded             # from the repository root; see benchmarks/README.md

The same harness as :mod:`benchmarks.run`: one local Ray cluster owned by this process, each
measurement a fresh driver process (:mod:`benchmarks.sharded_measure`), round-robin over the
contenders (:mod:`benchmarks.sharded_workload`), the same threads per process. Writes
``<out>/<name>.json`` (every sample) and ``<out>/<name>.md`` (:mod:`benchmarks.sharded`)
and prints the markdown.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

import torch

from benchmarks import options, run
from benchmarks.report import Metric, add_ratios, cell, failure_lines, median, metric_rows, per_contender, summaries
from benchmarks.sharded_workload import BARE, BASELINE, CONTENDERS, OURS, STEP_REFERENCE, ShardedSpec

_SIZES = {
    "workers": "training processes per fit (2)",
    "blocks": "blocks of the model (16)",
    "hidden": "width of the blocks (1024; a block is 8 x width^2)",
    "features": "input width (512)",
    "steps": "optimizer steps per fit (12)",
    "warmup": "steps left out of the step time (4)",
    "batch_size": "per worker (16)",
}


def _spec(args: argparse.Namespace, spec: ShardedSpec) -> None:
    gpus = torch.cuda.device_count()
    spec.gpu = args.device == "gpu" or (args.device == "auto" and gpus >= spec.workers)
    if spec.gpu and gpus < spec.workers:
        # Before the Ray cluster starts: no contender could run.
        sys.exit(
            f"benchmarks.sharded --device gpu needs {spec.workers} CUDA GPU(s), one per worker (--workers); this "
            f"machine has {gpus} (torch.cuda.is_available() is {torch.cuda.is_available()}, torch {torch.__version__})."
        )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    device = {"choices": ("auto", "cpu", "gpu"), "default": "auto",
              "help": "auto (default): GPUs where there is one per worker, else CPUs"}  # fmt: skip
    return options.parse(argv, __doc__, "sharded", CONTENDERS, ShardedSpec, _SIZES, options=[("--device", device)],
                     check=_spec)  # fmt: skip


# -- The tables: The sharded benchmark's table: samples, medians and spread, ratios against Lightning's own, the three
# goals.
METRICS = (
    Metric("model_mb", "model, MB", ".3g"),
    Metric("fit_s", "fit, s", ".1f"),
    Metric("first_step_s", "fit → 1st step, s", ".1f"),
    Metric("step_ms", "step, ms", ".0f"),
    Metric("step_cpu_ms", "step CPU, ms", ".0f"),
    Metric("weights_home_s", "full weights home, s", ".2f"),
    Metric("weights_speed_vs_copy", "weights home speed / copy speed", ".2f"),
    Metric("peak_rss_mb", "driver peak RSS, MB", ".0f"),
    # Sampled every 20 ms during fit (not where the driver trains): the object store's memory the driver maps.
    Metric("peak_shmem_mb", "of which shared (object store), MB", ".0f"),
    Metric("built_rss_mb", "driver RSS before fit, MB", ".0f"),
)
# The bare driver's row shows its memory only: its times are those of a model of a few KB.
_BARE_METRICS = {"model_mb", "peak_rss_mb", "peak_shmem_mb", "built_rss_mb"}
STEP_SLACK = 1.03
WEIGHTS_SPEED_FLOOR = 0.25
MEMORY_FACTOR = 1.2


def build(results: list[dict[str, Any]], order: list[str]) -> dict[str, Any]:
    """Per contender and metric: samples, median, spread, and the ratio of medians against Lightning's own."""

    def entry(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
        homes = [r["weights_home"] for r in runs if r["weights_home"] is not None]
        return {
            "label": CONTENDERS[name].label,
            "note": CONTENDERS[name].note,
            "repeats": len(runs),
            "metrics": summaries(runs, METRICS),
            # The driver's module held the trained weights after fit (None: they do not come home).
            "weights_returned": all(h["weights_changed"] for h in homes) if homes else None,
        }

    table = per_contender(results, order, entry)
    return add_ratios(table, BASELINE, "ratio", skip=("model_mb",), rows=set(table) - {BARE})


def _bounds(table: dict[str, Any], name: str) -> list[tuple[str, str, float | None, float | None, bool]]:
    """(goal, metric, value, bound, whether a larger value is better) for ray_lightning's contender ``name``."""
    step, speed, peak = (median(table, name, k) for k in ("step_ms", "weights_speed_vs_copy", "peak_rss_mb"))
    reference = median(table, STEP_REFERENCE.get(name, BASELINE), "step_ms")
    model, bare = median(table, name, "model_mb"), median(table, BARE, "peak_rss_mb")
    return [
        ("steady-state step within 3% of Lightning's own", "step_ms", step,
         None if reference is None else STEP_SLACK * reference, False),
        ("full weights home at >= 1/4 of memcpy speed", "weights_speed_vs_copy", speed, WEIGHTS_SPEED_FLOOR, True),
        ("driver peak RSS <= 1.2 x model + bare driver's", "peak_rss_mb", peak,
         None if model is None or bare is None else MEMORY_FACTOR * model + bare, False),
    ]  # fmt: skip


def goals(table: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal for each of ray_lightning's contenders that ran: met, missed, or unknown (a reference is missing)."""
    rows = []
    for name in (n for n in OURS if n in table):
        for goal, metric, value, bound, larger_is_better in _bounds(table, name):
            if value is None or bound is None:
                status = "unknown"
            else:
                status = "met" if (value >= bound if larger_is_better else value <= bound) else "missed"
            rows.append({"goal": goal, "contender": name, "metric": metric, "value": value, "bound": bound,
                         "status": status})  # fmt: skip
    return rows


def _header(document: dict[str, Any]) -> list[str]:
    spec, machine = document["spec"], document["machine"]
    gpus = ", ".join(machine.get("gpus") or ["none found"])
    device = f"1 GPU: {gpus}" if spec["gpu"] else f"{machine['threads_per_process']} torch thread(s)"
    return [
        f"{spec['workers']} workers ({device} each), {spec['steps']} steps (step time: median after "
        f"{spec['warmup']}), batch {spec['batch_size']} per worker; model: Linear {spec['features']}→{spec['hidden']}, "
        f"{spec['blocks']} blocks (LayerNorm, Linear {spec['hidden']}→{4 * spec['hidden']}, GELU, Linear back, "
        f"residual), Linear →{spec['classes']}, float32, SGD with momentum; each block one fully_shard unit. "
        f"{document['repeats']} repeat(s), each a fresh driver process, round-robin.",
        f"Machine: {machine['cpus']} CPUs, {machine['memory_gb']:.0f} GB; torch {machine['torch']}, "
        f"Lightning {machine['pytorch_lightning']}, Ray {machine['ray']}.",
        "",
        f"Cells: median (min–max) ×ratio of medians against {CONTENDERS[BASELINE].label}.",
    ]


def _number(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _goal_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| goal | contender | value | bound | status |", "| --- | --- | ---: | ---: | --- |"]
    for row in rows:
        value, bound = (_number(x) for x in (row["value"], row["bound"]))
        lines.append(f"| {row['goal']} | {CONTENDERS[row['contender']].label} | {value} | {bound} | {row['status']} |")
    return lines


def markdown(document: dict[str, Any]) -> str:
    """The tables as markdown, to print and to paste into benchmarks/README.md."""
    table = document["table"]

    def write(name: str, metric: Metric, summary: dict[str, Any] | None) -> str:
        shown = name != BARE or metric.key in _BARE_METRICS
        return cell(summary, metric.fmt, "ratio") if shown else "—"

    lines = [*_header(document), "", *metric_rows(table, METRICS, "ratio", write=write)]
    lines += ["", *(f"- {entry['label']}: {entry['note']}." for entry in table.values())]
    lines += [f"- {CONTENDERS[name].label}: not run: {why}." for name, why in document["skipped"].items()]
    lines += ["", *_goal_lines(document["goals"])]
    return "\n".join(lines + failure_lines(document)) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    spec = args.spec
    names = args.contenders.split(",")
    skipped = {n: why for n in names if (why := CONTENDERS[n].unavailable(spec))}
    runnable = argparse.Namespace(**{**vars(args), "contenders": ",".join(n for n in names if n not in skipped)})

    def judge(results: list, errors: list) -> dict[str, Any]:
        table = build(results, names)
        return {"table": table, "goals": goals(table), "skipped": skipped}

    measure = partial(run._measure_all, runnable, spec, entry="benchmarks.sharded_measure")
    return run.benchmark(args, argv, "sharded", measure, judge, markdown)


if __name__ == "__main__":
    run.entry(main)
