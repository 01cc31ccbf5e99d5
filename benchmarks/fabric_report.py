"""The Fabric benchmark's tables: every metric's samples, median and spread, ratios against Fabric's ``ddp_spawn``,
the goals judged, and the markdown."""

from __future__ import annotations

from typing import Any

from benchmarks.fabric_measure import BASELINE, CONTENDERS, LAUNCHES
from benchmarks.report import Metric, cell, failure_lines, summarize

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
    table = {}
    for name in order:
        runs = [r for r in results if r["contender"] == name]
        if not runs:
            continue
        metrics = {m.key: summarize([r["metrics"].get(m.key) for r in runs]) for m in METRICS}
        breakdown = {
            launch: {m.key: summarize([r["launches"][launch][m.key] for r in runs]) for m in BREAKDOWN}
            for launch in LAUNCHES
        }
        table[name] = {"label": CONTENDERS[name].label, "repeats": len(runs), "metrics": metrics,
                       "breakdown": breakdown}  # fmt: skip
    base = table.get(BASELINE)
    for entry in table.values():
        for key, summary in entry["metrics"].items():
            reference = base["metrics"][key] if base else None
            if key != "other_load_cores" and summary and reference and reference["median"]:
                summary[_RATIO] = summary["median"] / reference["median"]
    return table


def targets(table: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal for every Ray contender: met, missed, or unknown (no ddp_spawn run)."""
    rows = []
    for what, key, check in TARGETS:
        for name in (n for n in table if n != BASELINE):
            summary = table[name]["metrics"][key] or {}
            ratio = summary.get(_RATIO)
            reference = ((table.get(BASELINE) or {}).get("metrics", {}).get(key) or {}).get("median")
            status = "unknown" if ratio is None else ("met" if check(ratio) else "missed")
            rows.append({"target": what, "contender": name, "metric": key, "value": summary.get("median"),
                         "reference": reference, "ratio": ratio, "status": status})  # fmt: skip
    return rows


def _scaled(summary: dict[str, Any] | None, factor: float) -> dict[str, Any] | None:
    if summary is None:
        return None
    return {k: ([v * factor for v in x] if k == "samples" else x * factor) for k, x in summary.items()}


def _number(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else f"{value:{fmt}}"


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
        "| contender | " + " | ".join(m.title for m in METRICS) + " |",
        "| --- |" + " ---: |" * len(METRICS),
    ]
    for entry in table.values():
        cells = [cell(entry["metrics"][m.key], m.fmt, _RATIO) for m in METRICS]
        lines.append(f"| {entry['label']} | " + " | ".join(cells) + " |")
    lines += [
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
            cell(_scaled(entry["breakdown"][launch][m.key], 1000 if m.key == "step_s" else 1), m.fmt)
            for launch in LAUNCHES
            for m in BREAKDOWN
        ]
        lines.append(f"| {entry['label']} | " + " | ".join(cells) + " |")
    if document["targets"]:
        lines += ["", "| goal (reported, not asserted) | contender | value | against | ratio | status |",
                  "| --- | --- | ---: | ---: | ---: | --- |"]  # fmt: skip
        for row in document["targets"]:
            value, against, ratio = (_number(row[k], fmt) for k, fmt in (("value", ".3g"), ("reference", ".3g"),
                                                                          ("ratio", ".3f")))  # fmt: skip
            label = CONTENDERS[row["contender"]].label
            status = row["status"]
            lines.append(f"| {row['target']} | {label} | {value} | {against} ({BASELINE}) | {ratio} | {status} |")
    return "\n".join(lines + failure_lines(document)) + "\n"
