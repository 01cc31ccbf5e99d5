"""The Tune benchmark: a Population Based Training search, ray_lightning's Tune support against Ray Train v2 in Tune.

    .venv/bin/python -m benchmarks.tune            # from the repository root; see benchmarks/README.md

Both contenders run the same search (:mod:`benchmarks.tune_measure`): ``--trials`` trials of ``--workers`` workers
each, PBT over the learning rate every ``--interval`` reports, ``--reports`` reports of ``--steps`` optimizer steps
per trial, the whole population at once. The harness of :mod:`benchmarks.run`: one local Ray cluster owned by
this process (a logical CPU per trial process and per worker of every trial), round-robin
over the contenders, each search in a fresh driver process. A thread samples the machine's other load
(:mod:`benchmarks.fabric_load`). Writes ``<out>/<name>.json`` (every sample) and ``<out>/<name>.md``
(:mod:`benchmarks.tune`) and prints the markdown.
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

from benchmarks import options, run
from benchmarks.fabric import other_load
from benchmarks.report import (
    Metric,
    add_ratios,
    failure_lines,
    metric_rows,
    per_contender,
    ratio_target_lines,
    ratio_targets,
    summaries,
)
from benchmarks.tune_measure import BASELINE, CONTENDERS
from benchmarks.tune_workload import TuneSpec

_SIZES = {
    "workers": "training processes per trial (2)",
    "trials": "PBT's population, num_samples (4)",
    "reports": "validation reports per trial (8)",
    "steps": "optimizer steps between two reports (60)",
    "interval": "PBT's perturbation_interval, in reports (2)",
}


def _check(args: argparse.Namespace, spec: TuneSpec) -> str | None:
    if spec.trials < 2 or spec.interval >= spec.reports:
        return "PBT needs --trials 2 or more, and --interval below --reports (else nothing exploits)"
    return None


def _parse(argv: list[str] | None) -> argparse.Namespace:
    repeats = (2, "fresh driver processes (searches) per contender (2)")
    return options.parse(argv, __doc__, "tune", CONTENDERS, TuneSpec, _SIZES, repeats, check=_check)


# -- The tables: The Tune benchmark's tables: every metric's samples, median and spread, ratios ray_lightning / Ray
# Train, the goals judged, and the markdown.
METRICS = (
    Metric("search_s", "search wall time, s", ".1f"),
    Metric("best_acc", "best final val acc", ".3f"),
    Metric("exploits", "PBT exploits", ".0f"),
    Metric("exploits_skipped", "exploits skipped: no checkpoint", ".0f"),
    Metric("first_start_s", "1st trial start → 1st batch, s", ".2f"),
    Metric("later_start_s", "later trial starts → 1st batch, s", ".2f"),
    Metric("other_load_cores", "machine's other load, cores", ".2f"),
)
# How the trials started (medians over the searches): not every contender has restarts.
STARTS = (
    Metric("other_first_start_s", "other trials' 1st start → 1st batch, s", ".2f"),
    Metric("starts", "trial starts", ".0f"),
    Metric("restarts", "of them restarts", ".0f"),
    Metric("resumed_starts", "resumed from a checkpoint", ".0f"),
    Metric("restart_s", "restart → 1st batch, s", ".2f"),
)
# (the goal, the metric, check(ratio of medians ray_lightning / Ray Train)).
TARGETS = (
    ("shorter search wall time", "search_s", lambda ratio: ratio < 1.0),
    ("equal or better best accuracy (within 1%)", "best_acc", lambda ratio: ratio >= 0.99),
    ("later trial starts reach their 1st batch sooner", "later_start_s", lambda ratio: ratio < 1.0),
)
_RATIO = "ratio_vs_" + BASELINE
_NO_RATIO = ("other_load_cores",)


def build(results: list[dict[str, Any]], order: list[str]) -> dict[str, Any]:
    """Per contender: each metric's samples, median, spread and ratio of medians against Ray Train; trial errors."""

    def entry(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "label": CONTENDERS[name].label,
            "repeats": len(runs),
            "metrics": summaries(runs, METRICS + STARTS),
            "trial_errors": [t["error"] for r in runs for t in r["trials"] if t["error"]],
            "skipped_log": next((r["skipped_log"][0] for r in runs if r["skipped_log"]), None),
        }

    return add_ratios(per_contender(results, order, entry), BASELINE, skip=_NO_RATIO)


def targets(table: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal for every contender but Ray Train: met, missed, or unknown (no Ray Train run)."""
    return ratio_targets(table, BASELINE, TARGETS)


def _header(document: dict[str, Any]) -> list[str]:
    spec, machine, load = document["spec"], document["machine"], document["load"]
    other = "n/a" if load["other_cores"] is None else f"{load['other_cores']:.2f} cores"
    return [
        f"PBT over the learning rate (log-uniform {spec['lr_min']:g}–{spec['lr_max']:g}, SGD momentum 0.9): "
        f"{spec['trials']} trials × {spec['workers']} workers, {spec['reports']} reports of {spec['steps']} "
        f"optimizer steps per trial (batch {spec['batch_size']} per worker, MLP {spec['features']}-{spec['hidden']}-"
        f"{spec['hidden']}-{spec['classes']}), perturbation_interval={spec['interval']} reports, "
        f"every trial at once (a {spec['trials'] * (1 + spec['workers'])}-CPU Ray cluster), "
        f"reuse_actors=True; {document['repeats']} search(es) per contender. Machine: {machine['cpus']} CPUs; "
        f"torch {machine['torch']}, Lightning {machine['pytorch_lightning']}, Ray {machine['ray']}; "
        f"{machine['threads_per_process']} torch thread(s) per process. Load average before the run: "
        f"{load['loadavg_before'][0]:.2f} (1 min); the machine's other load over the run: {other}.",
        "",
        f"Cells: median (min–max) ×ratio of medians against {BASELINE}. search wall time = `Tuner.fit()` called → "
        "returned; best final val acc = the best trial's last reported validation accuracy; PBT exploits = "
        "PBT's `[Exploit] Cloning trial` log records, skipped = its `no checkpoint for trial ... Skip exploit`; "
        "1st trial start = the search's first start of a trial's function → that trial's rank 0 starts its first "
        "batch; later trial starts = the median of every other start (the other trials' first starts, and restarts "
        "after a PBT pause or exploit).",
        "",
    ]


def markdown(document: dict[str, Any]) -> str:
    table = document["table"]
    lines = [*_header(document), *metric_rows(table, METRICS, _RATIO), ""]
    lines += ["The later starts split (medians over the searches): the other trials' first starts (cold, beside the "
              "first), and restarts = a trial's second and later starts (after a PBT exploit, or a pause while another "
              "trial was paused); resumed = rank 0's first batch came after step 0 (training went on from a "
              "checkpoint).", ""]  # fmt: skip
    lines += metric_rows(table, STARTS, None)
    lines += ratio_target_lines(document["targets"], CONTENDERS, "Ray Train")
    notes = [f"- {e['label']}: PBT logged `{e['skipped_log']}`" for e in table.values() if e["skipped_log"]]
    notes += [f"- {e['label']}: a trial failed: `{err.splitlines()[0]}`" for e in table.values()
              for err in e["trial_errors"]]  # fmt: skip
    if notes:
        lines += ["", *notes]
    return "\n".join(lines + failure_lines(document)) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    judge = run.tables(args, build, targets)
    measure = partial(run._measure_all, args, args.spec, entry="benchmarks.tune_measure")
    return run.benchmark(args, argv, "tune", measure, judge, markdown, other_load=other_load)


if __name__ == "__main__":
    run.entry(main)
