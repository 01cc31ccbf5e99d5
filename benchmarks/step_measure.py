"""One measurement of the small-step benchmark: a fresh driver process runs one fit and writes what it saw.

    python -m benchmarks.step_measure --contender ray --spec spec.json --result result.json

Started by :mod:`benchmarks.step`. Ray contenders connect to the harness's cluster before the timer
starts; then one ``fit`` of :class:`~benchmarks.workload.BenchModule` (``spec.steps`` steps), timed
from just before ``trainer.fit`` on the driver, with rank 0's :class:`~benchmarks.workload.StepClock`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.contenders import CONTENDERS, GPU_CONTENDERS, Contender
from benchmarks.measure import _fit_metrics, measurement_main
from benchmarks.workload import BenchModule, Spec, read_clock

# RayStrategy with and without the progress watchdog, against ddp_spawn (the baseline).
STEP_CONTENDERS = ("ray", "ray_no_watchdog", "ddp_spawn")
# --device gpu: RayStrategy's workers on GPUs against Lightning's own Trainer on the same GPUs (the baseline).
GPU_STEP_CONTENDERS = tuple(GPU_CONTENDERS)


@dataclass
class StepSpec(Spec):
    """The main benchmark's MLP, narrower, and more steps: a step of 8-9 ms with 2 workers on 2 cores."""

    hidden: int = 384
    steps: int = 300
    warmup: int = 30
    # Every contender trains on GPUs (one per worker).
    gpu: bool = False

    @classmethod
    def tiny(cls) -> StepSpec:
        return cls(batch_size=16, features=32, hidden=64, classes=4, steps=12, warmup=4, smoke=True)

    @classmethod
    def on_gpu(cls, tiny: bool = False) -> StepSpec:
        """The sizes on one GPU per worker: the MLP 8192 wide, batch 512, a step of a few ms on a current GPU."""
        spec = cls.tiny() if tiny else cls(batch_size=512, hidden=8192)
        spec.workers, spec.gpu = 1, True
        return spec


def measure(contender: Contender, spec: StepSpec, result_path: str, record: bool) -> dict[str, Any] | None:
    """Run the fit; return the measurement."""
    if contender.uses_ray:
        import ray

        ray.init(address=spec.ray_address, log_to_driver=True)
    module = BenchModule(spec)
    clock_path = f"{result_path}.clock"
    t0 = time.time()
    trainer = contender.fit(spec, module, clock_path, spec.steps)
    t1 = time.time()
    strategy = getattr(trainer, "strategy", None)
    # RayStrategy's own accounts: each rank's phases per step, and where the time from fit to the first step went.
    timings = {str(r): t.per_step_ms() for r, t in getattr(strategy, "timings", {}).items()}
    startup = [list(mark) for mark in getattr(strategy, "startup", [])]
    fit = _fit_metrics(spec, t0, t1, read_clock(clock_path))
    metrics = {
        "step_ms": fit["step_s"] * 1000,
        "step_cpu_ms": fit["step_cpu_s"] * 1000,
        "fit_s": fit["wall_s"],
        "first_step_s": fit["first_step_s"],
        "launch_s": fit["launch_s"],
        "return_s": fit["return_s"],
    }
    return {"contender": contender.name, "pid": os.getpid(), "fit": fit, "metrics": metrics, "timings": timings,
            "startup": startup}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    contenders = {**{name: CONTENDERS[name] for name in STEP_CONTENDERS}, **GPU_CONTENDERS}
    measurement_main(argv, __doc__, contenders, StepSpec, measure)


if __name__ == "__main__":
    main()
