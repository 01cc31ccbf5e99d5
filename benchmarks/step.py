"""The small-step benchmark: what RayStrategy adds to a training step of a few milliseconds, and to the first fit.

    .venv/bin/python -m benchmarks.step            # from the repository root; see benchmarks/README.md

A step of 8-9 ms (the MLP of :mod:`benchmarks.workload`, narrower; 2 workers on 2 cores) shows a
per-step cost that the main benchmark's 25 ms step hides. The harness of :mod:`benchmarks.run`: one
local Ray cluster owned by this process, the same threads per process, round-robin over the
contenders, each measurement a fresh driver process (:mod:`benchmarks.step_measure`) that runs one
fit: its first, Ray up before the timer starts. Writes ``<out>/<name>.json`` (every sample) and
``<out>/<name>.md`` and prints the markdown.

``--device gpu``: one worker on a GPU (``RayStrategy(num_workers=1, use_gpu=True)``) against Lightning's
own Trainer on the same GPU (``accelerator="cuda", devices=1``), the MLP wider (:meth:`StepSpec.on_gpu`);
refused, before anything starts, where there are fewer CUDA GPUs than workers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from typing import Any

import torch

from benchmarks import options, run
from benchmarks.contenders import BASELINE, CONTENDERS, GPU_BASELINE, GPU_CONTENDERS
from benchmarks.report import Metric, add_ratios, metric_rows, per_contender, summaries
from benchmarks.step_measure import GPU_STEP_CONTENDERS, STEP_CONTENDERS, StepSpec
from ray_lightning.channel.timings import PHASES

METRICS = (
    Metric("step_ms", "step, ms", ".2f"),
    Metric("step_cpu_ms", "step CPU, ms", ".2f"),
    Metric("fit_s", "fit, s", ".2f"),
    Metric("first_step_s", "fit → 1st step, s", ".2f"),
    Metric("launch_s", "launch, s", ".2f"),
    Metric("return_s", "return, s", ".2f"),
)
# (the target, the metric, the largest ratio of medians against ddp_spawn that meets it)
TARGETS = (
    ("steady-state step within 2% of ddp_spawn", "step_ms", 1.02),
    ("fit no slower than ddp_spawn", "fit_s", 1.0),
)
# On GPUs (the goal): the first fit's ratio is shown, not judged (Ray's workers start as processes).
GPU_TARGETS = (("steady-state step within 2% of Lightning's own on the GPU", "step_ms", 1.02),)
_SIZES = {
    "steps": "optimizer steps of the fit (300)",
    "warmup": "steps left out of the step time (30)",
    "batch_size": "per worker (128; 512 on GPUs)",
    "hidden": "width of the MLP's hidden layers (384; 8192 on GPUs)",
}
_LABELS = {name: c.label for name, c in {**CONTENDERS, **GPU_CONTENDERS}.items()}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="fresh driver processes per contender (default 5)")
    parser.add_argument("--workers", type=int, default=None, help="training processes per fit (2; 1 on GPUs)")
    options.add_sizes(parser, _SIZES)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="cpu (default): RayStrategy against ddp_spawn; gpu: one GPU per worker, RayStrategy "
                        "against Lightning's own Trainer on the GPU")  # fmt: skip
    options.add_run_options(parser, STEP_CONTENDERS, "step-<start time>")
    # The default contenders depend on --device.
    parser.set_defaults(contenders="")
    args = parser.parse_args(argv)
    gpu = args.device == "gpu"
    names = GPU_STEP_CONTENDERS if gpu else STEP_CONTENDERS
    args.contenders = args.contenders or ",".join(names)
    options.check_contenders(parser, args, names)
    spec = StepSpec.on_gpu(args.tiny) if gpu else StepSpec.tiny() if args.tiny else StepSpec()
    args.spec = options.sizes_of(args, spec, _SIZES)
    args.spec.workers = args.workers or args.spec.workers
    if gpu and torch.cuda.device_count() < args.spec.workers:
        # Before the Ray cluster starts: there is nothing to measure.
        sys.exit(
            f"benchmarks.step --device gpu needs {args.spec.workers} CUDA GPU(s), one per worker; this machine has "
            f"{torch.cuda.device_count()} (torch.cuda.is_available() is {torch.cuda.is_available()}, torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda})."
        )
    args.baseline, args.targets = (GPU_BASELINE, GPU_TARGETS) if gpu else (BASELINE, TARGETS)
    return args


def build(results: list[dict[str, Any]], order: list[str], baseline: str = BASELINE) -> dict[str, Any]:
    """Per contender: each metric's samples, median, spread and ratio of medians against ``baseline``."""

    def entry(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"label": _LABELS[name], "repeats": len(runs), "metrics": summaries(runs, METRICS)}

    return add_ratios(per_contender(results, order, entry), baseline)


def targets(
    table: dict[str, Any], baseline: str = BASELINE, judged: tuple[tuple[str, str, float], ...] = TARGETS
) -> list[dict[str, Any]]:
    """Each target (``judged``) for every ray_lightning contender: met, missed, or unknown (no ``baseline`` run)."""
    rows = []
    for what, key, bound in judged:
        for name in (n for n in table if n != baseline and n.startswith("ray")):
            ratio = (table[name]["metrics"][key] or {}).get("ratio_vs_" + baseline)
            status = "unknown" if ratio is None else ("met" if ratio <= bound else "missed")
            rows.append({"target": what, "contender": name, "metric": key, "ratio": ratio, "status": status})
    return rows


def markdown(document: dict[str, Any]) -> str:
    spec, machine, table = document["spec"], document["machine"], document["table"]
    baseline = document.get("baseline", BASELINE)
    device = f"GPU: {', '.join(machine.get('gpus') or ['none found'])}; " if spec.get("gpu") else ""
    lines = [
        f"{spec['workers']} workers, one fit of {spec['steps']} steps per driver process (step: median after "
        f"{spec['warmup']}), batch {spec['batch_size']}, MLP {spec['features']}-{spec['hidden']}-{spec['hidden']}-"
        f"{spec['classes']}; {document['repeats']} repeat(s). Machine: {machine['cpus']} CPUs; {device}torch "
        f"{machine['torch']}, Lightning {machine['pytorch_lightning']}, Ray {machine['ray']}; "
        f"{machine['threads_per_process']} torch thread(s) per process.",
        "",
        f"Cells: median (min–max) ×ratio of medians against {baseline}. launch = `fit` called → rank 0's "
        "`on_fit_start`; return = rank 0's `on_fit_end` → `fit` returned; step CPU = rank 0's process.",
        "",
        *metric_rows(table, METRICS, "ratio_vs_" + baseline),
    ]
    if document["targets"]:
        lines += ["", "| target | contender | ratio | status |", "| --- | --- | ---: | --- |"]
        for row in document["targets"]:
            ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.3f}"
            lines.append(f"| {row['target']} | {_LABELS[row['contender']]} | {ratio} | {row['status']} |")
    lines += phase_lines(document["measurements"]) + startup_lines(document["measurements"])
    lines += [f"- failed: {e['contender']}, repeat {e['repeat'] + 1}" for e in document["errors"]]
    return "\n".join(lines) + "\n"


def phase_lines(measurements: list[dict[str, Any]]) -> list[str]:
    """Each rank's step split into its phases (``trainer.strategy.timings``), medians over the repeats."""
    lines = []
    for name in dict.fromkeys(m["contender"] for m in measurements):
        runs = [m["timings"] for m in measurements if m["contender"] == name and m.get("timings")]
        if not runs:
            continue
        if not lines:
            lines = ["", "Where each rank's step went (`trainer.strategy.timings`, ms per step, medians over the "
                     "repeats; collective: how long backward waited for DDP's all-reduce after the rank's own "
                     "gradients):", "",
                     "| contender | rank | " + " | ".join(PHASES) + " | step |",
                     "| --- | ---: |" + " ---: |" * (len(PHASES) + 1)]  # fmt: skip
        for rank in sorted(runs[0], key=int):
            ms = {p: statistics.median(r[rank][p] for r in runs if rank in r) for p in PHASES}
            cells = " | ".join(f"{ms[p]:.2f}" for p in PHASES)
            lines.append(f"| {_LABELS[name]} | {rank} | {cells} | {sum(ms.values()):.2f} |")
    return lines


def startup_lines(measurements: list[dict[str, Any]]) -> list[str]:
    """Where the time between ``fit`` and the first step went (``trainer.strategy.startup``), of each contender's
    first measurement: one fresh driver process, Ray already up."""
    lines = []
    for name in dict.fromkeys(m["contender"] for m in measurements):
        run = next((m for m in measurements if m["contender"] == name and m.get("startup")), None)
        if run is None:
            continue
        lines += ["", f"From `fit` to the first step, {_LABELS[name]} (its first measurement; rank 0's marks):", "",
                  "| mark | s since `fit` | s since the mark before |", "| --- | ---: | ---: |"]  # fmt: skip
        lines += [f"| {mark} | {since:.2f} | {step:.2f} |" for mark, since, step in run["startup"]]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)

    def judge(results: list, errors: list) -> dict[str, Any]:
        table = build(results, args.contenders.split(","), args.baseline)
        return {"baseline": args.baseline, "table": table, "targets": targets(table, args.baseline, args.targets)}

    measure = partial(run._measure_all, args, args.spec, entry="benchmarks.step_measure")
    return run.benchmark(args, argv, "step", measure, judge, markdown)


if __name__ == "__main__":
    run.entry(main)
