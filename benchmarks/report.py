"""The table: every measurement's samples, their median and spread, ratios against ``ddp_spawn``, the targets."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from benchmarks.contenders import BASELINE, CONTENDERS


@dataclass(frozen=True)
class Metric:
    key: str
    title: str
    # How the table writes a value (a format spec).
    fmt: str


METRICS = (
    Metric("fit_s", "fit, s", ".2f"),
    Metric("first_step_s", "fit → 1st step, s", ".2f"),
    Metric("step_ms", "step, ms", ".1f"),
    Metric("fit2_s", "2nd fit, s", ".2f"),
    Metric("fit2_first_step_s", "2nd fit → 1st step, s", ".2f"),
    Metric("weights_back_s", "weights back, s", ".3g"),
    Metric("weights_speed_vs_copy", "weights back speed / copy speed", ".2g"),
    Metric("peak_rss_mb", "driver peak RSS, MB", ".0f"),
)
# Where the time of a fit goes (medians): see `benchmarks.measure._fit_metrics`.
BREAKDOWN = ("launch_s", "setup_s", "return_s", "step_cpu_s")


def summarize(samples: list[float | None]) -> dict[str, Any] | None:
    """Median and min–max of the samples that exist; None when there are none (not applicable)."""
    values = [s for s in samples if s is not None]
    if not values:
        return None
    return {"samples": values, "median": statistics.median(values), "min": min(values), "max": max(values)}


def per_contender(
    results: list[dict[str, Any]], order: list[str], entry: Callable[[str, list[dict[str, Any]]], dict[str, Any]]
) -> dict[str, Any]:
    """``entry(name, its measurements)`` for each name of ``order`` that has measurements, in that order."""
    runs = {name: [r for r in results if r["contender"] == name] for name in order}
    return {name: entry(name, of_name) for name, of_name in runs.items() if of_name}


def summaries(runs: list[dict[str, Any]], metrics: Iterable[Metric], get: str | None = "metrics") -> dict[str, Any]:
    """Each metric's :func:`summarize` over ``runs`` (their ``get`` dicts, or themselves; a missing value is no
    sample)."""
    return {m.key: summarize([(r[get] if get else r).get(m.key) for r in runs]) for m in metrics}


def add_ratios(
    table: dict[str, Any], baseline: str, ratio_key: str | None = None, skip: Iterable[str] = (), rows: Any = None
) -> dict[str, Any]:
    """Each summary's ratio of medians against ``baseline``'s (under ``ratio_key``, default ``ratio_vs_<baseline>``),
    where both exist, but for the metrics in ``skip`` and the rows not in ``rows`` (default all)."""
    base = table.get(baseline, {}).get("metrics", {})
    for name, entry in table.items():
        for key, summary in entry["metrics"].items():
            reference = base.get(key)
            if (rows is None or name in rows) and key not in skip and summary and reference and reference["median"]:
                summary[ratio_key or "ratio_vs_" + baseline] = summary["median"] / reference["median"]
    return table


def ratio_targets(
    table: dict[str, Any], baseline: str, judged: Iterable[tuple[str, str, Callable[[float], bool]]], names: Any = None
) -> list[dict[str, Any]]:
    """Each target ``(what, metric, check(ratio))`` for every contender of ``names`` (default: all but
    ``baseline``) in the table: met, missed, or unknown (no ``baseline`` run)."""
    rows = []
    for what, key, check in judged:
        for name in (n for n in table if n != baseline and (names is None or n in names)):
            summary = table[name]["metrics"][key] or {}
            ratio = summary.get("ratio_vs_" + baseline)
            reference = ((table.get(baseline) or {}).get("metrics", {}).get(key) or {}).get("median")
            status = "unknown" if ratio is None else ("met" if check(ratio) else "missed")
            rows.append({"target": what, "contender": name, "metric": key, "value": summary.get("median"),
                         "reference": reference, "ratio": ratio, "status": status})  # fmt: skip
    return rows


def ratio_target_lines(
    rows: list[dict[str, Any]], contenders: dict[str, Any], against: str, suffix: str = ""
) -> list[str]:
    """The goals of :func:`ratio_targets` as markdown (none: no lines): value, the reference (column ``against``,
    ``suffix`` after each value), the ratio and the status, a row per goal and contender."""
    if not rows:
        return []
    lines = ["", f"| goal (reported, not asserted) | contender | value | {against} | ratio | status |",
             "| --- | --- | ---: | ---: | ---: | --- |"]  # fmt: skip
    for row in rows:
        value, reference, ratio = (number(row[k], f) for k, f in (("value", ".3g"), ("reference", ".3g"),
                                                                    ("ratio", ".3f")))  # fmt: skip
        label = contenders[row["contender"]].label
        lines.append(f"| {row['target']} | {label} | {value} | {reference}{suffix} | {ratio} | {row['status']} |")
    return lines


def metric_rows(
    table: dict[str, Any],
    metrics: tuple[Metric, ...],
    ratio_key: str | None,
    first: str = "contender",
    named: bool = False,
    write: Callable[[str, Metric, dict[str, Any] | None], str] | None = None,
) -> list[str]:
    """A markdown table: a row per entry of ``table`` (its label; ``named``: `` `name`: label``), a :func:`cell` per
    metric (or ``write(name, metric, summary)``); ``first``: the title of the first column."""
    lines = [f"| {first} | " + " | ".join(m.title for m in metrics) + " |", "| --- |" + " ---: |" * len(metrics)]
    for name, entry in table.items():
        summaries = [(m, entry["metrics"][m.key]) for m in metrics]
        cells = [write(name, m, s) if write else cell(s, m.fmt, ratio_key) for m, s in summaries]
        label = f"`{name}`: {entry['label']}" if named else entry["label"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def number(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else f"{value:{fmt}}"


def build(results: list[dict[str, Any]], order: list[str]) -> dict[str, Any]:
    """Per contender and metric: samples, median, spread, and the ratio of medians against the baseline."""

    def entry(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "label": CONTENDERS[name].label,
            "note": CONTENDERS[name].note,
            "repeats": len(runs),
            "metrics": summaries(runs, METRICS),
            "breakdown": {
                fit: {k: summarize([r["fits"][fit][k] for r in runs]) for k in BREAKDOWN} for fit in ("fit1", "fit2")
            },
            # The driver's module held trained weights after the weights-back fit (Ray Train brings
            # them back only there, through a checkpoint).
            "weights_returned": all(r["fits"]["weights"]["weights_changed"] for r in runs),
        }

    return add_ratios(per_contender(results, order, entry), BASELINE)


def median(table: dict[str, Any], name: str, key: str) -> float | None:
    """The median of ``name``'s ``key`` in a table (None: no such run or no sample)."""
    summary = table.get(name, {}).get("metrics", {}).get(key)
    return summary["median"] if summary else None


# (the target, the contender it compares with or None for an absolute bound, the metric, check(ours, theirs))
_TARGETS: tuple[tuple[str, str | None, str, Callable[[float, float], bool]], ...] = (
    ("steady-state step within 3% of Lightning ddp", "ddp", "step_ms", lambda o, t: o <= 1.03 * t),
    ("fit no slower than ddp_spawn", "ddp_spawn", "fit_s", lambda o, t: o <= t),
    ("fit at least 1.5x faster than Ray Train", "ray_train", "fit_s", lambda o, t: 1.5 * o <= t),
    ("2nd fit reaches its 1st step in under 1 s", None, "fit2_first_step_s", lambda o, _: o < 1.0),
    ("weights back at >= 1/4 of in-memory copy speed", None, "weights_speed_vs_copy", lambda o, _: o >= 0.25),
)
OURS = ("ray", "horovod_ray")


def targets(table: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target for each of ray_lightning's contenders: met, missed, or unknown (a contender was not run)."""
    rows = []
    for what, other, key, check in _TARGETS:
        for name in (n for n in OURS if n in table):
            ours = median(table, name, key)
            theirs = median(table, other, key) if other else 0.0
            status = "unknown" if ours is None or theirs is None else ("met" if check(ours, theirs) else "missed")
            rows.append({"target": what, "contender": name, "metric": key, "value": ours, "reference": theirs,
                         "reference_contender": other, "status": status})  # fmt: skip
    return rows


def cell(summary: dict[str, Any] | None, fmt: str, ratio_key: str = "ratio_vs_" + BASELINE) -> str:
    """A table cell: median (min–max) ×ratio, the ratio read from ``ratio_key`` where the summary has one."""
    if summary is None:
        return "n/a"
    text = f"{summary['median']:{fmt}}"
    if len(summary["samples"]) > 1:
        text += f" ({summary['min']:{fmt}}–{summary['max']:{fmt}})"
    ratio = summary.get(ratio_key)
    if ratio is not None:
        text += f" ×{ratio:.2f}"
    return text


def scaled(summary: dict[str, Any] | None, factor: float) -> dict[str, Any] | None:
    """``summary`` with every value times ``factor`` (s to ms, say)."""
    if summary is None or factor == 1:
        return summary
    return {k: ([v * factor for v in x] if k == "samples" else x * factor) for k, x in summary.items()}


def markdown(report: dict[str, Any]) -> str:
    """The tables as markdown, to print and to paste into benchmarks/README.md."""
    table, spec, machine = report["table"], report["spec"], report["machine"]
    lines = [
        f"{spec['workers']} workers, {spec['steps']} steps per fit (step time: median after {spec['warmup']}), "
        f"batch {spec['batch_size']}, MLP {spec['features']}-{spec['hidden']}-{spec['hidden']}-{spec['classes']}, "
        f"weights model {spec['weights_params'] / 1e6:g}M float32 parameters; "
        f"{report['repeats']} repeat(s), each a fresh driver process.",
        f"Machine: {machine['cpus']} CPUs, {machine['memory_gb']:.0f} GB; torch {machine['torch']}, "
        f"Lightning {machine['pytorch_lightning']}, Ray {machine['ray']}, Horovod {machine['horovod']}; "
        f"{machine['threads_per_process']} torch thread(s) per process.",
        "",
        f"Cells: median (min–max) ×ratio of medians against {BASELINE}.",
        "",
    ]
    lines += metric_rows(table, METRICS, "ratio_vs_" + BASELINE)
    notes = [f"- {entry['label']}: {entry['note']}." for entry in table.values() if entry["note"]]
    lines += ["", *notes] if notes else []
    lines += [
        "",
        "Where the time of a fit goes (medians, s): launch = `fit` called → rank 0's `on_fit_start`; "
        "setup = → its first batch; return = rank 0's `on_fit_end` → `fit` returned; step CPU = CPU time of "
        "rank 0's process per steady-state step, ms (not inflated by waiting for a busy machine's cores).",
        "",
        "| contender | 1st fit: launch | setup | return | step CPU | 2nd fit: launch | setup | return | step CPU |",
        "| --- |" + " ---: |" * 2 * len(BREAKDOWN),
    ]
    for entry in table.values():
        cells = [
            cell(scaled(entry["breakdown"][fit][key], 1000 if key == "step_cpu_s" else 1), ".2f")
            for fit in ("fit1", "fit2")
            for key in BREAKDOWN
        ]
        lines.append(f"| {entry['label']} | " + " | ".join(cells) + " |")
    rows = report["targets"]
    if rows:
        lines += ["", "| target | contender | value | against | status |", "| --- | --- | ---: | ---: | --- |"]
        for row in rows:
            value = "n/a" if row["value"] is None else f"{row['value']:.3g}"
            other = row["reference_contender"]
            against = "" if other is None else ("n/a" if row["reference"] is None else f"{row['reference']:.3g}")
            against += f" ({other})" if other else ""
            label = CONTENDERS[row["contender"]].label
            lines.append(f"| {row['target']} | {label} | {value} | {against} | {row['status']} |")
    return "\n".join(lines + failure_lines(report)) + "\n"


def failure_lines(document: dict[str, Any]) -> list[str]:
    """The end of every benchmark's markdown: the measurements that failed, and those measured again after a crash
    or hang (their first driver's is in the JSON, ``crashed_before``)."""
    crashed = [m for m in document["measurements"] if m.get("crashed_before")]
    lines: list[str] = []
    for entries, key, title in (
        (document["errors"], "error", "Failed measurements (the JSON has the end of each driver's log):"),
        (crashed, "crashed_before", "Measured again after a crash or hang (the JSON has the end of the log):"),
    ):
        if entries:
            lines += ["", title]
            lines += [f"- {e['contender']}, repeat {e['repeat'] + 1}: {e[key].splitlines()[0]}" for e in entries]
    return lines
