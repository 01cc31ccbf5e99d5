"""The spot-pattern benchmark's tables: per contender the time to train the samples, the final accuracy against the
uninterrupted run's, the restarts and world sizes, the pattern's timing; the ratios, the goals and the markdown
(:mod:`benchmarks.elastic` runs it)."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from benchmarks.elastic_driver import CONTENDERS, ElasticSpec
from benchmarks.report import Metric, cell, failure_lines, per_contender, summarize

REFERENCE = "uninterrupted"
OURS = "elastic"
METRICS = (
    Metric("fit_s", "time to train the samples, s", ".1f"),
    Metric("acc", "final val acc", ".4f"),
    Metric("acc_delta", "acc − uninterrupted's (same round)", "+.4f"),
    Metric("restarts", "restarts", ".0f"),
    Metric("absence_s", "node away (loss → added back), s", ".1f"),
    Metric("recovery_s", "loss → training again, s", ".1f"),
    Metric("grow_s", "node back → training on 3, s", ".1f"),
    Metric("decide_s", "node joined → grow decided (RayStrategy), s", ".1f"),
    Metric("samples_percent", "samples trained, % of the fixed number", ".1f"),
    Metric("other_load_cores", "machine's other load, cores", ".2f"),
)
# The ratios of the goal: elastic's median over each of these contenders' (< 1: elastic is faster).
AGAINST = ("fixed", "ray_train", REFERENCE)
# Two runs "reach the same accuracy" when their final accuracies differ by at most this much (1 point).
SAME_ACCURACY = 0.01


def _first_after(attempts: list[dict[str, Any]], t: float, world_size: int | None = None) -> float | None:
    """The end of the first batch of the first attempt that started after ``t`` (at ``world_size``, where given)."""
    for attempt in attempts:
        size_ok = world_size is None or attempt["world_size"] == world_size
        if attempt["t"] >= t and size_ok and attempt["first_batch_end"] is not None:
            return attempt["first_batch_end"]
    return None


def metrics(result: dict[str, Any], spec: dict[str, Any], reference_acc: float | None) -> dict[str, Any]:
    """One measurement's numbers, from the driver's result, rank 0's records and the pattern's events."""
    attempts = result["attempts"]
    events = {e["event"]: e for e in result.get("events", [])}
    lost, back = events.get("lost"), events.get("back")
    samples = spec["epochs"] * spec["train_size"]
    trained = sum(a.get("samples", 0) for a in attempts)
    recovery = _first_after(attempts, lost["t"]) if lost else None
    grow = _first_after(attempts, back["t"], spec["workers"]) if back else None
    # When the driver decided to grow (RayStrategy's Restart.failed_at), from when the node had joined Ray.
    grows = [
        r["failed_at"]
        for r in result.get("restarts", [])
        if back and r["reason"] == "grow" and r["failed_at"] >= back["t"]
    ]
    return {
        "fit_s": result["fit_s"],
        "acc": result["acc"],
        "acc_delta": result["acc"] - reference_acc if reference_acc is not None else None,
        "restarts": max(len(attempts) - 1, 0),
        "absence_s": result.get("absence_s"),
        "recovery_s": recovery - lost["t"] if recovery is not None else None,
        "grow_s": grow - back["t"] if grow is not None else None,
        "decide_s": grows[0] - back["done"] if grows else None,
        "samples_percent": trained / samples * 100 if trained else None,
        "other_load_cores": result.get("other_load_cores"),
    }


def _world_sizes(result: dict[str, Any]) -> str:
    return "→".join(str(a["world_size"]) for a in result["attempts"])


def _reasons(result: dict[str, Any]) -> list[str]:
    """Why each restart happened: RayStrategy's Restart records; for Ray Train, what the world sizes show."""
    if "restarts" in result:
        return [str(r.get("reason")) for r in result["restarts"]]
    sizes = [a["world_size"] for a in result["attempts"]]
    return ["grow" if b > a else ("shrink" if b < a else "same size") for a, b in zip(sizes, sizes[1:])]


def build(results: list[dict[str, Any]], order: list[str], spec: ElasticSpec | dict[str, Any]) -> dict[str, Any]:
    """Per contender: each metric's samples, median and spread, the world sizes and restart reasons of every run, and
    elastic's ratios of medians against the others."""
    spec = spec if isinstance(spec, dict) else asdict(spec)
    reference = {r["repeat"]: r["acc"] for r in results if r["contender"] == REFERENCE}
    reference_median = statistics.median(reference.values()) if reference else None

    def entry(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
        per_run = [metrics(r, spec, reference.get(r["repeat"], reference_median)) for r in runs]
        for measured, numbers in zip(runs, per_run):
            measured["metrics"] = numbers
        return {
            "label": CONTENDERS[name].label,
            "repeats": len(runs),
            "metrics": {m.key: summarize([n[m.key] for n in per_run]) for m in METRICS},
            "world_sizes": [_world_sizes(r) for r in runs],
            "reasons": [_reasons(r) for r in runs],
            "per_worker_batches": [[a.get("per_worker_batch") for a in r["attempts"]] for r in runs],
            "absence_source": sorted({r["absence_source"] for r in runs if r.get("absence_source")}),
            "pattern_errors": [r["pattern_error"] for r in runs if r.get("pattern_error")],
        }

    table = per_contender(results, order, entry)
    ours = table.get(OURS)
    if ours is not None:
        for name in AGAINST:
            theirs = table.get(name)
            if theirs is not None and theirs["metrics"]["fit_s"]:
                ours["metrics"]["fit_s"][f"ratio_vs_{name}"] = (
                    ours["metrics"]["fit_s"]["median"] / theirs["metrics"]["fit_s"]["median"]
                )
    return table


def targets(table: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals: elastic finishes the samples sooner than the fixed size and than Ray Train's elastic
    training, with the uninterrupted run's final accuracy (within :data:`SAME_ACCURACY`)."""
    rows = []
    ours = (table.get(OURS) or {}).get("metrics", {})
    for name in ("fixed", "ray_train"):
        ratio = (ours.get("fit_s") or {}).get(f"ratio_vs_{name}")
        status = "unknown" if ratio is None else ("met" if ratio < 1.0 else "missed")
        rows.append({"target": f"elastic trains the samples sooner than `{name}` (time ratio < 1)", "contender": OURS,
                     "value": ratio, "unit": "×", "status": status})  # fmt: skip
    for name, entry in table.items():
        if name == REFERENCE:
            continue
        delta = (entry["metrics"]["acc_delta"] or {}).get("median")
        status = "unknown" if delta is None else ("met" if abs(delta) <= SAME_ACCURACY else "missed")
        goal = "the goal" if name == OURS else "for comparison"
        rows.append({"target": f"final accuracy within {SAME_ACCURACY:g} of the uninterrupted run's ({goal})",
                     "contender": name, "value": delta, "unit": "", "status": status})  # fmt: skip
    return rows


def _header(document: dict[str, Any]) -> list[str]:
    spec, machine, load = document["spec"], document["machine"], document["load"]
    other = "n/a" if load["other_cores"] is None else f"{load['other_cores']:.2f} cores"
    samples = spec["epochs"] * spec["train_size"]
    return [
        f"{samples} samples: {spec['epochs']} epochs of {spec['train_size']} (MLP {spec['features']}-{spec['hidden']}-"
        f"{spec['hidden']}-{spec['classes']} on teacher-labelled data, SGD lr {spec['lr']:g} momentum 0.9, global "
        f"batch {spec['workers'] * spec['batch_size']} at every world size, each step sleeping {spec['sample_ms']:g} "
        f"ms per sample of a worker's batch: a node's own compute). One cluster for the run: a 0-CPU head and "
        f"{spec['workers']} 1-CPU worker nodes, all alive at each start; a worker node (not rank 0's) removed at "
        f"{spec['lose_at']:.0%} of the "
        f"samples (rank 0's progress), a node added back at {spec['back_at']:.0%} (the fixed size: after the elastic "
        f"run's absence of the same round). max_failures={spec['max_failures']} everywhere; Ray Train's "
        f"elastic_resize_monitor_interval_s={spec['resize_monitor_s']:g}. {document['repeats']} round(s), each "
        f"measurement a fresh driver process.",
        "",
        f"Machine: {machine['cpus']} CPUs, {machine['memory_gb']:.0f} GB; torch {machine['torch']}, Lightning "
        f"{machine['pytorch_lightning']}, Ray {machine['ray']}; {machine['threads_per_process']} torch thread(s) per "
        f"process. Load average before the run: {load['loadavg_before'][0]:.2f} (1 min); the machine's other load "
        f"over the run: {other}.",
        "",
        "Cells: median (min–max); the elastic row's time carries its ratio of medians against each other contender "
        "(`×fixed`, `×ray_train`, `×uninterrupted`). Time to train the samples = the driver's `fit` (Ray Train: "
        "`TorchTrainer.fit()`) called → returned, Ray connected before. Final val acc: the driver evaluates the "
        "trained weights on the held-out set (Ray Train: its last reported checkpoint). Restarts = rank 0's "
        "training starts − 1; loss → training again = the node's removal → the first batch of the next attempt; "
        "node back → training on 3 = the node's return → the first batch of the next 3-worker attempt; samples "
        "trained counts every batch rank 0 saw × world size, work redone after a restart included.",
        "",
    ]


def _time_cell(summary: dict[str, Any] | None) -> str:
    text = cell(summary, ".1f", "none")
    for name in AGAINST:
        ratio = (summary or {}).get(f"ratio_vs_{name}")
        if ratio is not None:
            text += f" ×{ratio:.2f} {name}"
    return text


def markdown(document: dict[str, Any]) -> str:
    table = document["table"]
    lines = [*_header(document)]
    lines += ["| contender | " + " | ".join(m.title for m in METRICS) + " | world sizes | restart reasons |",
              "| --- |" + " ---: |" * len(METRICS) + " --- | --- |"]  # fmt: skip
    for entry in table.values():
        cells = [_time_cell(entry["metrics"]["fit_s"])]
        cells += [cell(entry["metrics"][m.key], m.fmt, "none") for m in METRICS[1:]]
        sizes = "; ".join(entry["world_sizes"])
        reasons = "; ".join(", ".join(r) or "–" for r in entry["reasons"])
        lines.append(f"| {entry['label']} | " + " | ".join(cells) + f" | {sizes} | {reasons} |")
    if document["targets"]:
        lines += ["", "| goal | contender | value | status |", "| --- | --- | ---: | --- |"]
        for row in document["targets"]:
            value = "n/a" if row["value"] is None else f"{row['value']:.3f}{row['unit']}"
            lines.append(f"| {row['target']} | `{row['contender']}` | {value} | {row['status']} |")
    notes = [f"- {e['label']}: per-worker batch per attempt {e['per_worker_batches']}" for e in table.values()]
    notes += [f"- {e['label']}: the node came back after the absence of {', '.join(e['absence_source'])}"
              for e in table.values() if e["absence_source"]]  # fmt: skip
    notes += [f"- {e['label']}: the spot pattern failed: {err}" for e in table.values() for err in e["pattern_errors"]]
    lines += ["", *notes]
    return "\n".join(lines + failure_lines(document)) + "\n"
