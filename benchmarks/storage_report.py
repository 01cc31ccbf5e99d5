"""The storage benchmark's tables: samples, medians and spread per case, ratios against the references, the goals
(reported, not asserted), and the markdown (:mod:`benchmarks.storage` runs it)."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.report import Metric, cell, failure_lines, median, metric_rows, per_contender, summarize
from benchmarks.storage_driver import CASES, Case, StorageSpec

MEMORY_METRICS = (
    Metric("model_mb", "model, MB", ".0f"),
    Metric("driver_peak_rss_mb", "driver peak RSS, MB", ".0f"),
    Metric("driver_peak_shmem_mb", "of which shared (object store), MB", ".0f"),
    Metric("rank0_peak_rss_mb", "rank 0 peak RSS, MB", ".0f"),
    Metric("rank1_peak_rss_mb", "rank 1 peak RSS, MB", ".0f"),
    Metric("rank0_over_rank1", "rank 0 / rank 1", ".2f"),
    # Each rank's peak over the same rank's in the run without recovery checkpoints (median): what checkpoints add.
    Metric("rank0_added_mb", "rank 0 added, MB", ".0f"),
    Metric("rank1_added_mb", "rank 1 added, MB", ".0f"),
    Metric("checkpoint_mb", "checkpoint in the bucket, MB", ".0f"),
    Metric("fit_s", "fit, s", ".1f"),
)
COST_METRICS = (
    Metric("state_mb", "weights + Adam state, MB", ".0f"),
    Metric("checkpoint_mb", "checkpoint in the bucket, MB", ".0f"),
    Metric("blocked_s", "training blocked per checkpoint, s", ".3f"),
    Metric("first_blocked_s", "1st checkpoint, s", ".3f"),
    Metric("blocked_share_pct", "blocked / an epoch's steps, %", ".2f"),
    Metric("upload_wait_s", "of which waiting for the last upload, s", ".3f"),
    Metric("step_ms", "step, ms (median)", ".0f"),
    Metric("mean_step_ms", "step, ms (mean, epochs 2+, checkpoints included)", ".0f"),
    # (mean step - the same strategy's without checkpoints) x steps per epoch: blocked time and the cores the
    # uploads (and the S3 server, on this machine) took from training.
    Metric("added_per_checkpoint_s", "training time added per checkpoint, s", ".2f"),
    Metric("server_cpu_per_checkpoint_s", "S3 server CPU per checkpoint, s", ".2f"),
    Metric("fit_s", "fit, s", ".1f"),
)
RESUME_METRICS = (
    Metric("start_first_step_s", "driver start → 1st step, s", ".1f"),
    Metric("fit_first_step_s", "fit() → 1st step, s", ".1f"),
    Metric("launch_s", "fit() → rank 0's on_fit_start, s", ".1f"),
    Metric("setup_s", "on_fit_start → 1st batch, s", ".1f"),
    Metric("kill_first_step_s", "kill → 1st step, s", ".1f"),
    Metric("resumed_step", "resumed at step", ".0f"),
    Metric("start_to_end_s", "driver start → exit, s", ".1f"),
    Metric("fit_s", "fit, s", ".1f"),
    Metric("checkpoint_mb", "checkpoint in the bucket, MB", ".0f"),
)
METRICS = {"memory": MEMORY_METRICS, "cost": COST_METRICS, "resume": RESUME_METRICS}
MEMORY_BASELINE = "mem_none"


def memory_reference(case: Case) -> str:
    """The fit without recovery checkpoints a memory case is compared with: the same strategy's."""
    return MEMORY_BASELINE if case.sharded else "mem_ddp_none"


RESUME_BASELINE = "cold_start"
# Per part: the metrics compared (×ratio of medians) with the part's reference case.
_RATIO_KEYS = {
    "memory": ("driver_peak_rss_mb", "rank0_peak_rss_mb", "rank1_peak_rss_mb"),
    "resume": ("start_first_step_s", "fit_first_step_s", "launch_s", "setup_s", "start_to_end_s"),
}
# Bounds of the goals (issue: report, do not assert).
DRIVER_SLACK = 1.05
RANK_SLACK = 1.10
ASYNC_SHARE_OF_SYNC = 0.10
STEP_SHARE_PCT = 2.0
# The cases judged against the goals, per goal.
MEMORY_JUDGED = ("mem_storage", "mem_driver", "mem_ddp_driver")
ASYNC_JUDGED = ("cost_fsdp_async", "cost_ddp_async")
# ray_lightning's DDP cases against Ray Train's with the same upload mode.
AGAINST_RAY_TRAIN = {"cost_ddp_sync": "ray_train_sync", "cost_ddp_async": "ray_train_async"}


def step_reference(case: Case) -> str:
    """The case without checkpoints whose step a cost case's is compared with: the same strategy's (Ray Train:
    RayStrategy's DDP, the same model and gloo all-reduce)."""
    return "cost_fsdp_none" if case.sharded else "cost_ddp_none"


def build(results: list[dict[str, Any]], order: list[str], spec: StorageSpec) -> dict[str, Any]:
    """Per case and metric: samples, median, spread; ratios and percentages against the references."""

    def built(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
        case = CASES[name]
        _add_derived(runs, case, results, spec)
        return {
            "label": case.label,
            "part": case.part,
            "repeats": len(runs),
            "metrics": {m.key: summarize([r["metrics"].get(m.key) for r in runs]) for m in METRICS[case.part]},
            "final_global_steps": [r["metrics"]["final_global_step"] for r in runs],
        }

    table = per_contender(results, order, built)
    for name, entry in table.items():
        case = CASES[name]
        if case.part == "cost":
            _ratio(entry, table.get(case.against or ""), "added_per_checkpoint_s", "added_per_checkpoint_s")
        reference = {"memory": memory_reference(case), "resume": RESUME_BASELINE}.get(case.part)
        for key in _RATIO_KEYS.get(case.part, ()):
            _ratio(entry, table.get(reference or ""), key, key)
        if case.part == "cost":
            # The asynchronous upload against the save that waits for it; each strategy's step against its own
            # without checkpoints (percent).
            _ratio(entry, table.get(case.against or ""), "blocked_s", "blocked_s")
            for key in ("step_ms", "mean_step_ms"):
                base = median(table, step_reference(case), key)
                summary = entry["metrics"][key]
                if summary is not None and base and name != step_reference(case):
                    summary["percent"] = (summary["median"] / base - 1) * 100
    return table


def _referencemedian(results: list[dict[str, Any]], name: str, key: str) -> float | None:
    values = [r["metrics"][key] for r in results if r["contender"] == name and r["metrics"].get(key) is not None]
    return statistics.median(values) if values else None


def _add_derived(runs: list[dict[str, Any]], case: Case, results: list[dict[str, Any]], spec: StorageSpec) -> None:
    """The metrics of each run that need the reference case's (median): what checkpoints add to memory and time."""
    for measured in runs:
        metrics = measured["metrics"]
        if case.part == "memory":
            for rank in (0, 1):
                key = f"rank{rank}_peak_rss_mb"
                base = _referencemedian(results, memory_reference(case), key)
                ok = base is not None and metrics.get(key) is not None and case.name != memory_reference(case)
                metrics[f"rank{rank}_added_mb"] = metrics[key] - base if ok else None
        elif case.part == "cost":
            base = _referencemedian(results, step_reference(case), "mean_step_ms")
            ok = base is not None and case.checkpoints
            added = (metrics["mean_step_ms"] - base) * spec.cost_steps / 1000 if ok else None
            metrics["added_per_checkpoint_s"] = added


def _ratio(entry: dict[str, Any], reference: dict[str, Any] | None, key: str, reference_key: str) -> None:
    ours = entry["metrics"].get(key)
    theirs = reference["metrics"].get(reference_key) if reference else None
    if ours is not None and theirs is not None and theirs["median"] and reference is not entry:
        ours["ratio"] = ours["median"] / theirs["median"]


def _judged(goal: str, name: str, value: float | None, bound: float, note: str = "") -> dict[str, Any]:
    status = "unknown" if value is None else "met" if value <= bound else "missed"
    return {"goal": goal, "case": name, "value": value, "bound": bound, "status": status, "note": note}


def goals(table: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal for each ray_lightning case it is about that ran: met, missed, or unknown (a reference is missing)."""
    rows = []
    for name in (n for n in MEMORY_JUDGED if n in table):
        driver = table[name]["metrics"]["driver_peak_rss_mb"]
        rows.append(_judged("driver peak RSS within 5% of the run without restarts", name,
                            driver.get("ratio") if driver else None, DRIVER_SLACK))  # fmt: skip
        rows.append(_judged("rank 0's peak RSS within 10% of rank 1's", name,
                            median(table, name, "rank0_over_rank1"), RANK_SLACK))  # fmt: skip
        added0, added1 = median(table, name, "rank0_added_mb"), median(table, name, "rank1_added_mb")
        rows.append(_judged("what checkpoints add to rank 0's peak RSS within 10% of rank 1's", name,
                            added0 / added1 if added0 is not None and added1 and added1 > 0 else None,
                            RANK_SLACK))  # fmt: skip
    for name in (n for n in ASYNC_JUDGED if n in table):
        blocked = table[name]["metrics"]["blocked_s"]
        rows.append(_judged("blocked time under 10% of a synchronous save", name,
                            blocked.get("ratio") if blocked else None, ASYNC_SHARE_OF_SYNC))  # fmt: skip
        share, step_ms = median(table, name, "blocked_share_pct"), median(table, name, "step_ms")
        per_checkpoint = median(table, name, "blocked_s")
        note = ""
        if per_checkpoint is not None and step_ms:
            # The epoch length at which this checkpoint's blocked time is 2% of the step time.
            note = f"met with epochs of {per_checkpoint / (STEP_SHARE_PCT / 100 * step_ms / 1000):.0f}+ steps"
        rows.append(_judged("blocked time under 2% of step time, a checkpoint every epoch", name, share,
                            STEP_SHARE_PCT, note))  # fmt: skip
    return rows


def _number(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _cell(summary: dict[str, Any] | None, fmt: str) -> str:
    text = cell(summary, fmt, "ratio")
    if summary is not None and "percent" in summary:
        text += f" {summary['percent']:+.1f}%"
    return text


def _header(document: dict[str, Any]) -> list[str]:
    spec, machine = document["spec"], document["machine"]
    block = f"LayerNorm, Linear {spec['hidden']}→{4 * spec['hidden']}, GELU, Linear back, residual"
    return [
        f"{spec['workers']} workers, {machine['threads_per_process']} torch thread(s) each, batch "
        f"{spec['batch_size']} per worker; the sharded benchmark's model: Linear {spec['features']}→{spec['hidden']}, "
        f"N blocks ({block}), Linear →{spec['classes']}, float32, each block one FSDP unit. S3: moto's server on a "
        f"loopback port of the same machine. {document['repeats']} repeat(s), each a fresh driver process, "
        "round-robin.",
        f"Machine: {machine['cpus']} CPUs, {machine['memory_gb']:.0f} GB; torch {machine['torch']}, "
        f"Lightning {machine['pytorch_lightning']}, Ray {machine['ray']}.",
    ]


_PART_INTRO = {
    "memory": "**Memory** ({blocks} blocks, SGD with momentum: a checkpoint of twice the model; {epochs} epochs of "
    "{steps} steps, a recovery checkpoint at every epoch end). Cells: median (min–max) ×ratio of medians against "
    "the run without recovery checkpoints. Peak RSS: `ru_maxrss` of the driver after `fit`, and of each rank's "
    "process at its `teardown` (after its last upload).",
    "cost": "**Training time a checkpoint costs** ({cost_blocks} blocks, Adam; {cost_epochs} epochs of {cost_steps} "
    "steps, a checkpoint at every epoch end). Blocked: how long the epoch-end checkpoint held the training thread "
    "(its `on_train_epoch_end`, timed in every rank; the longest rank, median over the fit's checkpoints but "
    "the first, which is shown apart); "
    "the synchronous cases also wait there for the upload. ×: against the synchronous save of the same "
    "strategy; %: the step against the same strategy's without checkpoints.",
    "resume": "**Resume after a lost driver** ({cost_blocks} blocks, Adam, {cost_epochs} epochs of {cost_steps} "
    "steps). `resume`: a driver is SIGKILLed once its first recovery checkpoint is complete in the bucket (its "
    "`COMPLETE.json`), then the same script runs again with the same `run_name`; `cold_start`: the same script "
    "with a new `run_name`. Times from the driver process's start (`Popen`) to rank 0's first "
    "`on_before_optimizer_step`. ×: against the cold start.",
}


def _part_lines(document: dict[str, Any], part: str) -> list[str]:
    table = {n: e for n, e in document["table"].items() if e["part"] == part}
    if not table:
        return []
    metrics = METRICS[part]
    lines = ["", _PART_INTRO[part].format(**document["spec"]), ""]
    return lines + metric_rows(table, metrics, "ratio", "case", named=True, write=lambda _, m, s: _cell(s, m.fmt))


def _ray_train_lines(table: dict[str, Any]) -> list[str]:
    pairs = [(ours, theirs) for ours, theirs in AGAINST_RAY_TRAIN.items() if ours in table and theirs in table]
    if not pairs:
        return []
    lines = [
        "",
        "| blocked per checkpoint, s | ray_lightning RayStrategy | Ray Train | ratio |",
        "| --- | ---: | ---: | ---: |",
    ]
    for ours, theirs in pairs:
        a, b = median(table, ours, "blocked_s"), median(table, theirs, "blocked_s")
        ratio = f"×{a / b:.2f}" if a is not None and b else "n/a"
        lines.append(f"| {'synchronous' if 'sync' in ours and 'async' not in ours else 'in the background'} | "
                     f"{_number(a)} | {_number(b)} | {ratio} |")  # fmt: skip
    return lines


def _goal_lines(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = [
        "",
        "| goal (reported, not asserted) | case | value | bound | status |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for row in rows:
        status = row["status"] + (f" ({row['note']})" if row["note"] else "")
        lines.append(f"| {row['goal']} | `{row['case']}` | {_number(row['value'])} | {_number(row['bound'])} | "
                     f"{status} |")  # fmt: skip
    return lines


def markdown(document: dict[str, Any]) -> str:
    """The tables as markdown, to print and to paste into benchmarks/README.md."""
    lines = _header(document)
    for part in ("memory", "cost", "resume"):
        lines += _part_lines(document, part)
        if part == "cost":
            lines += _ray_train_lines(document["table"])
    lines += _goal_lines(document["goals"])
    return "\n".join(lines + failure_lines(document)) + "\n"
