"""The benchmark reports' main figures, drawn from their JSON: a PNG beside each ``.md``.

    .venv/bin/python -m benchmarks.plots benchmarks/results/step-20261127-140000.json   # draw (again) from a report

Which figure a report gets follows its ``command``: the step benchmark's step time per contender and each rank's
phases (``*.png``, ``*-phases.png``), the data benchmark's samples per second per contender, the elastic
benchmark's world size over time per contender; the others their table's first metric per contender. Plots read
faster than tables; the tables stay the record.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

PHASE_COLORS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no screen
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def bars(path: Path, title: str, unit: str, values: dict[str, list[float]]) -> Path:
    """One bar per contender: the median of its samples, the min–max as an error bar."""
    plt = _pyplot()
    names = list(values)
    medians = [statistics.median(values[n]) for n in names]
    low = [m - min(values[n]) for m, n in zip(medians, names)]
    high = [max(values[n]) - m for m, n in zip(medians, names)]
    figure, axes = plt.subplots(figsize=(7, 0.6 * len(names) + 1.5))
    axes.barh(names, medians, xerr=[low, high], color="#4c72b0", capsize=3)
    axes.invert_yaxis()
    axes.set_xlabel(unit)
    axes.set_title(title, fontsize=10)
    for y, m in enumerate(medians):
        axes.text(m, y, f" {m:.3g}", va="center", fontsize=8)
    return _save(plt, figure, path)


def stacked(path: Path, title: str, rows: dict[str, dict[str, float]], phases: tuple[str, ...]) -> Path:
    """One stacked bar per row (a contender's rank): milliseconds of each phase."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 0.5 * len(rows) + 1.8))
    left = [0.0] * len(rows)
    for phase, color in zip(phases, PHASE_COLORS):
        widths = [rows[r].get(phase, 0.0) for r in rows]
        axes.barh(list(rows), widths, left=left, color=color, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    axes.invert_yaxis()
    axes.set_xlabel("ms per step")
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=8, ncol=len(phases), loc="lower center", bbox_to_anchor=(0.5, -0.45))
    return _save(plt, figure, path)


def timeline(path: Path, title: str, series: dict[str, list[tuple[float, float]]]) -> Path:
    """World size (or any step function) over seconds since the start, one line per contender."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 3))
    for name, points in series.items():
        xs, ys = zip(*points)
        axes.step(xs, ys, where="post", label=name)
    axes.set_xlabel("s since fit")
    axes.set_ylabel("workers")
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=8)
    return _save(plt, figure, path)


def _samples(document: dict[str, Any], key: str) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    for run in document.get("measurements", []):
        value = run.get("metrics", {}).get(key)
        if isinstance(value, (int, float)):
            found.setdefault(run["contender"], []).append(float(value))
    return found


def _step(document: dict[str, Any], base: Path) -> list[Path]:
    steps = _samples(document, "step_ms")
    drawn = [bars(base.with_suffix(".png"), "A training step (median after warm-up)", "ms", steps)]
    phases: dict[str, dict[str, float]] = {}
    for run in document.get("measurements", []):
        for rank, ms in (run.get("timings") or {}).items():
            phases.setdefault(f"{run['contender']} rank {rank}", ms)  # the first repeat's
    if phases:
        from ray_lightning.channel.timings import PHASES

        drawn.append(stacked(base.with_name(base.name + "-phases.png"), "Where each rank's step went", phases, PHASES))
    return drawn


def _elastic(document: dict[str, Any], base: Path) -> list[Path]:
    series: dict[str, list[tuple[float, float]]] = {}
    for run in document.get("measurements", []):
        name = run["contender"]
        if name in series or not run.get("attempts"):
            continue
        points = [(a["t"] - run["t0"], a["world_size"]) for a in run["attempts"] if a.get("rank") == 0]
        series[name] = [*points, (run["t1"] - run["t0"], points[-1][1])] if points else []
    series = {name: points for name, points in series.items() if points}
    return [timeline(base.with_suffix(".png"), "Workers over time (first repeat)", series)] if series else []


def draw(json_path: str | Path) -> list[Path]:
    """The figures of one report (its JSON), written beside it; returns their paths."""
    path = Path(json_path)
    document = json.loads(path.read_text())
    base = path.with_suffix("")
    command = document.get("command") or ""
    command = " ".join(command) if isinstance(command, list) else str(command)
    if "benchmarks.step" in command:
        return _step(document, base)
    if "benchmarks.elastic" in command:
        return _elastic(document, base)
    if "benchmarks.data" in command:
        key, title = "epoch_samples_per_s", "Samples per second over the epoch"
        if document.get("spec", {}).get("ready"):
            key, title = "samples_per_s", "Samples per second, steady, the data ready"
        return [bars(base.with_suffix(".png"), title, "samples/s", _samples(document, key))]
    metric = next(iter(next(iter(document.get("table", {}).values()), {}).get("metrics", {})), None)
    found = _samples(document, metric) if metric else {}
    return [bars(base.with_suffix(".png"), metric or "", "", found)] if found else []


if __name__ == "__main__":
    for argument in sys.argv[1:]:
        for drawn in draw(argument):
            print(drawn)
