"""Where the Ray node's CPU went during a data-benchmark fit: :func:`node_cpu` snapshots every process of the node (rank
0 takes one at the end of the warm-up and one at the last step, :class:`~benchmarks.data_driver.DataClock`),
:func:`cpu_breakdown` puts the CPU between two snapshots into :data:`CPU_GROUPS` (per sample and as cores busy).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

_ENDED = "<exited>"


def node_cpu() -> dict[str, Any]:
    """The CPU seconds so far of every process of this Ray node (the raylet and its descendants: the training
    workers and their loader processes, Ray Data's tasks and actors, Ray's agents) and of the whole machine.

    Per process its own CPU and its ended children's (reaped by it): a process that ends between two snapshots
    (a DataLoader's at the end of its epoch) is counted from its parent's."""
    import psutil

    processes: dict[str, dict[str, Any]] = {}
    raylet = next((p for p in psutil.Process().parents() if p.name() == "raylet"), None)
    for process in [raylet, *raylet.children(recursive=True)] if raylet is not None else []:
        try:
            with process.oneshot():
                times, ppid = process.cpu_times(), process.ppid()
        except psutil.Error:
            continue  # gone meanwhile
        try:
            title = " ".join(process.cmdline())[:120]
        except psutil.Error:
            # A process that exited and is not reaped yet (a DataLoader's after its last batch): its CPU times
            # stay readable, its command line is gone.
            title = _ENDED
        processes[str(process.pid)] = {
            "title": title,
            "ppid": ppid,
            "cpu_s": times.user + times.system,
            "children_cpu_s": times.children_user + times.children_system,
            "raylet": process is raylet,
        }
    machine = psutil.cpu_times()
    busy = sum(getattr(machine, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))
    return {"at": time.time(), "machine_busy_s": busy, "processes": processes, "cpus": psutil.cpu_count()}


# Ray's own per-node processes (besides the raylet).
_AGENTS = ("DashboardAgent", "RuntimeEnvAgent")


def _group(pid: str, info: dict[str, Any], ranks: set[int]) -> str:
    """Which part of the pipeline a process of the Ray node is (see :data:`CPU_GROUPS`)."""
    title = info["title"]
    if int(pid) in ranks:
        return "ranks"
    if info["ppid"] in ranks:
        return "loaders"
    if info.get("raylet"):
        return "raylet"
    if title.startswith("ray::Coordinator"):
        return "coordinator"
    if title.startswith("ray::SplitCoordinator"):
        return "split_coordinator"
    if not title.startswith("ray::") or any(agent in title for agent in _AGENTS):
        return "agents"
    if title.startswith("ray::IDLE") or "MapBatches" in title or "ReadRange" in title:
        return "tasks"
    return "actors"


# Where the CPU of the Ray node went over the steady window: its processes in groups.
CPU_GROUPS = {
    "ranks": "training workers",
    "loaders": "DataLoader processes",
    "tasks": "Ray Data's tasks (ReadRange->MapBatches)",
    "coordinator": "RayDataModule's coordinator (runs the pipeline, hands out block references)",
    "split_coordinator": "Ray Data's SplitCoordinator (streaming_split: runs the pipeline, hands out block references)",
    "actors": "other actors (Ray Data's stats, Ray Train's controller...)",
    "raylet": "raylet",
    "agents": "Ray's agents",
}


def cpu_breakdown(snapshots: list[dict[str, Any]], ranks: set[int], samples: int) -> dict[str, Any] | None:
    """CPU seconds of each group of processes between the two snapshots, per sample (ms) and as cores busy."""
    if len(snapshots) != 2:
        return None
    first, last = snapshots
    wall = last["at"] - first["at"]
    groups: dict[str, float] = dict.fromkeys(CPU_GROUPS, 0.0)
    seen: set[str] = set()
    ended = sorted(set(first["processes"]) - set(last["processes"]))
    for pid, info in last["processes"].items():
        before = first["processes"].get(pid)
        # A process that started in the window counts whole; an idle Ray worker by what it ran before.
        named = info if info["title"] not in ("ray::IDLE", _ENDED) or before is None else before
        group = _group(pid, named, ranks)
        seen.add(group)
        groups[group] += info["cpu_s"] - (before["cpu_s"] if before else 0.0)
        # Its children that ended in the window: their CPU since the first snapshot, to the children's groups.
        reaped = info["children_cpu_s"] - (before["children_cpu_s"] if before else 0.0)
        children = [c for c in ended if first["processes"][c]["ppid"] == int(pid)]
        for child in children:
            reaped -= first["processes"][child]["cpu_s"]
        if reaped > 0:
            group = _group(children[0], first["processes"][children[0]], ranks) if children else "agents"
            groups[group] += reaped
    return {
        "wall_s": wall,
        "cpu_ms_per_sample": {g: s / samples * 1000 for g, s in groups.items()},
        "cores": {g: s / wall for g, s in groups.items()},
        "node_cores": sum(groups.values()) / wall,
        "machine_cores": (last["machine_busy_s"] - first["machine_busy_s"]) / wall,
        # The machine's busy cores that were not this Ray node's: the driver, the GCS, and any other work on the
        # machine (~0.1 when the benchmark has the machine to itself).
        "other_cores": (last["machine_busy_s"] - first["machine_busy_s"] - sum(groups.values())) / wall,
        "cpus": last["cpus"],
        # The groups that had a process at the window's end: one that used no CPU the clock could see (10 ms ticks)
        # is measured at 0, one absent is not measured.
        "found": sorted(seen),
        "ended_in_window": ended,
    }


def row_bytes(first_batch: dict[str, Any]) -> int:
    """The bytes of one row of a batch as it reached ``training_step`` (``DataClock.first_batch``'s shapes)."""
    total = 0
    for shape, dtype in first_batch.values():
        size = torch.empty((), dtype=getattr(torch, dtype.rsplit(".", 1)[-1])).element_size()
        total += size * math.prod(shape[1:])
    return total


def coordinating_s_per_gb(cpu: dict[str, Any], bytes_per_row: int) -> float | None:
    """CPU seconds of the process that runs the pipeline and hands out its blocks (RayDataModule's coordinator,
    Ray Data's SplitCoordinator under Ray Train), per GB of rows the workers trained on in the window.

    None when neither process was there; 0.0 when one was and used less than the clock's tick in the window (a
    ``--tiny`` pipeline can be done making its blocks before the window starts)."""
    coordinating = ("coordinator", "split_coordinator")
    if not bytes_per_row or not any(g in cpu.get("found", coordinating) for g in coordinating):
        return None
    return sum(cpu["cpu_ms_per_sample"][g] for g in coordinating) * 1e6 / bytes_per_row
