"""One Fabric-benchmark measurement: a fresh driver process launches the Fabric loop twice and writes what it saw.

    python -m benchmarks.fabric_measure --contender ray --spec spec.json --result result.json

Started by :mod:`benchmarks.fabric`. Ray's contender connects to the harness's cluster (and imports
ray_lightning) before any timer starts. Then, twice in this process: a new ``Fabric`` of the contender's strategy,
and ``fabric.launch(train, spec)`` (:func:`benchmarks.fabric_workload.train`), timed from just before the call
(``t0``) to its return, with rank 0's clock (which ``launch`` returns). The second launch is what a user's second
``fabric.launch`` in the same script costs: Fabric's ``ddp_spawn`` spawns its processes again, RayStrategy reuses
the workers the first launch left warm (``keep_workers_alive_s``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.fabric_workload import FabricSpec, train
from benchmarks.measure import _fit_metrics, measurement_main

try:
    from lightning.fabric import Fabric
except ImportError:
    from lightning_fabric import Fabric


@dataclass(frozen=True)
class FabricContender:
    """One way to run ``fabric.launch(train)`` on ``spec.workers`` processes: its name, label and ``Fabric``."""

    name: str
    label: str
    fabric: Callable[[FabricSpec], Any]
    uses_ray: bool


def _ddp_spawn(spec: FabricSpec) -> Any:
    return Fabric(accelerator="cpu", devices=spec.workers, strategy="ddp_spawn")


def _ray(spec: FabricSpec) -> Any:
    from ray_lightning import RayStrategy

    return Fabric(strategy=RayStrategy(num_workers=spec.workers))


CONTENDERS: dict[str, FabricContender] = {
    c.name: c
    for c in (
        FabricContender("ray", "Fabric(strategy=RayStrategy(num_workers=N))", _ray, uses_ray=True),
        FabricContender(
            "ddp_spawn", "Fabric(strategy='ddp_spawn', accelerator='cpu', devices=N) (gloo)", _ddp_spawn, uses_ray=False
        ),
    )
}
BASELINE = "ddp_spawn"
LAUNCHES = ("launch1", "launch2")


def launch_metrics(spec: FabricSpec, t0: float, t1: float, clock: dict[str, Any], warm: bool) -> dict[str, Any]:
    """What one launch shows: the Trainer benchmarks' metrics of a fit (``launch_s`` is the call → rank 0's function
    start), and that start split: ``process_s`` the call → rank 0's process created (negative: it was there before
    the call, a worker Ray started ahead or one the last launch left warm), ``process_to_function_s`` from the later
    of the two → its function started (Python, imports, the worker's setup, the process group), ``startup_cpu_s``
    the CPU rank 0's process had spent by then (None for a ``warm`` process: it trained in the last launch)."""
    process_start = clock["process_start"]
    return {
        **_fit_metrics(spec, t0, t1, clock),
        "process_s": None if process_start is None else process_start - t0,
        "process_to_function_s": clock["fit_start"] - max(process_start or t0, t0),
        "startup_cpu_s": None if warm else clock["cpu_at_start"],
    }


def measure(contender: FabricContender, spec: FabricSpec, result_path: str, record: bool) -> dict[str, Any]:
    """Launch the loop twice, each time with a new Fabric; return the measurement."""
    started = time.time()
    if contender.uses_ray:
        import ray

        import ray_lightning  # noqa: F401 - its import (Fabric's strategy names) is not the launch's time

        ray.init(address=spec.ray_address, log_to_driver=True)
    launches: dict[str, dict[str, Any]] = {}
    for label in LAUNCHES:
        c0 = time.time()
        fabric = contender.fabric(spec)
        t0 = time.time()
        clock = fabric.launch(train, spec)
        t1 = time.time()
        if clock is None:
            raise RuntimeError(f"{contender.name}: fabric.launch returned None, not rank 0's clock")
        warm = any(launch["pid"] == clock["pid"] for launch in launches.values())
        launches[label] = {**launch_metrics(spec, t0, t1, clock, warm), "pid": clock["pid"], "fabric_init_s": t0 - c0}
    first, second = (launches[label] for label in LAUNCHES)
    metrics = {
        "first_step_s": first["first_step_s"],
        "step_ms": first["step_s"] * 1000,
        "step_cpu_ms": first["step_cpu_s"] * 1000,
        "launch2_first_step_s": second["first_step_s"],
        "launch_s": first["wall_s"],
        "launch2_s": second["wall_s"],
    }
    return {
        "contender": contender.name,
        "pid": os.getpid(),
        "launches": launches,
        "metrics": metrics,
        # When this driver measured (time.time()): the harness reads the machine's other load over it.
        "window": [started, time.time()],
    }


def main(argv: list[str] | None = None) -> None:
    measurement_main(argv, __doc__, CONTENDERS, FabricSpec, measure)


if __name__ == "__main__":
    main()
