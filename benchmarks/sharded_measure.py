"""One measurement of the sharded benchmark: a fresh driver process runs one contender's fit and writes what it saw.

    python -m benchmarks.sharded_measure --contender ray_fsdp --spec spec.json --result result.json

Started by :mod:`benchmarks.sharded`, once per contender and repeat, as :mod:`benchmarks.measure` is
by :mod:`benchmarks.run`. In this process:

1. connect to the harness's Ray cluster (Ray contenders), build the Trainer and the module, before any timer;
2. one ``fit`` of ``spec.steps`` steps, timed from just before ``trainer.fit`` to its return; rank 0's
   clock gives the step times and when its ``on_fit_end`` ran, after which the full weights come home;
3. the driver's peak RSS, then the in-memory copy floor of the module's state dict (where it came home).

Lightning's own launcher re-runs this command line for rank 1: it runs the same fit and writes nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import torch

from benchmarks.measure import _copy_floor, _fit_metrics, _peak_rss_mb, _weights_changed, measurement_main
from benchmarks.sharded_workload import CONTENDERS, ShardedContender, ShardedModule, ShardedSpec
from benchmarks.workload import StepClock, pl, read_clock, trainer_kwargs


class MemorySampler:
    """The driver's RSS and its parts, every ``period_s`` during ``with``: the peak, and what it was made of.

    The object store's memory that this process maps (a payload it sent, weights it reads in place)
    counts in its RSS as shared memory (``RssShmem``), apart from its own (``RssAnon``). Linux only.
    """

    def __init__(self, period_s: float = 0.02) -> None:
        self.period_s = period_s
        self.peak: dict[str, float] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    @staticmethod
    def sample() -> dict[str, float]:
        """VmRSS, RssAnon, RssFile, RssShmem of this process in MB (empty where /proc is absent), and the time."""
        fields = {"VmRSS", "RssAnon", "RssFile", "RssShmem"}
        try:
            with open("/proc/self/status") as f:
                found = {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in f) if k in fields}
        except OSError:
            return {}
        return {**found, "time": time.time()}

    def _run(self) -> None:
        while not self._done.wait(self.period_s):
            now = self.sample()
            if now and now["VmRSS"] > self.peak.get("VmRSS", 0.0):
                self.peak = now

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def _phase(at: float | None, clock: dict[str, Any]) -> str | None:
    """When ``at`` was in a fit: before rank 0's on_fit_start (launch), during training, or after (return)."""
    if at is None:
        return None
    return "launch" if at < clock["fit_start"] else "train" if at < clock["fit_end"] else "return"


def _weights_home(module: ShardedModule, before: torch.Tensor | None, home_s: float) -> dict[str, Any]:
    """The weights-home numbers of a fit whose driver got the full trained weights ``home_s`` after rank 0's end."""
    weight = module.net[0].weight
    floor = _copy_floor(module.state_dict())
    return {
        "weights_home_s": home_s,
        "weights_floor_s": floor["clone_s"],
        "weights_speed_vs_copy": floor["clone_s"] / home_s,
        "floor": floor,
        # Trained weights arrived: changed since the fit began, or materialized where the module had none (meta).
        "weights_changed": not weight.is_meta and (before is None or _weights_changed(before, module)),
    }


def _build(contender: ShardedContender, spec: ShardedSpec, clock_path: str) -> tuple[pl.Trainer, ShardedModule]:
    """The Trainer and the module, as a user's script builds them."""
    module_spec = contender.module_spec(spec)
    trainer = pl.Trainer(
        **trainer_kwargs(module_spec, spec.steps), **contender.strategy(spec), callbacks=[StepClock(clock_path)]
    )
    with trainer.init_module(empty_init=True) if contender.empty_init else contextlib.nullcontext():
        module = contender.module(module_spec)
    return trainer, module


def _metrics(fit: dict[str, Any], home: dict[str, Any] | None, memory: dict[str, Any]) -> dict[str, Any]:
    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * 1000

    return {
        "fit_s": fit["wall_s"],
        "first_step_s": fit["first_step_s"],
        "step_ms": ms(fit["step_s"]),
        "step_cpu_ms": ms(fit["step_cpu_s"]),
        "weights_home_s": home and home["weights_home_s"],
        "weights_speed_vs_copy": home and home["weights_speed_vs_copy"],
        **memory,
    }


def measure(contender: ShardedContender, spec: ShardedSpec, result_path: str, record: bool) -> dict[str, Any] | None:
    """Run the fit; return the measurement (None on the ranks Lightning's launcher started)."""
    if contender.uses_ray:
        import ray

        ray.init(address=spec.ray_address, log_to_driver=True)
    clock_path = f"{result_path}.clock"
    trainer, module = _build(contender, spec, clock_path)
    model_bytes = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    built_rss = _peak_rss_mb()
    before = None if module.net[0].weight.is_meta else module.net[0].weight.detach().clone()
    # No sampler where the driver trains (rank 0 of Lightning's own): it would take its CPU.
    with contextlib.nullcontext() if contender.driver_is_rank_zero else MemorySampler() as sampler:
        t0 = time.time()
        trainer.fit(module)
        t1 = time.time()
    if not record:
        return None
    peak_rss = _peak_rss_mb()  # before the floor's copies add their own
    clock = read_clock(clock_path)
    fit = _fit_metrics(spec, t0, t1, clock)
    home = None if contender.driver_is_rank_zero else _weights_home(module, before, fit["return_s"])
    peak = sampler.peak if sampler else {}
    memory = {"peak_rss_mb": peak_rss, "peak_shmem_mb": peak.get("RssShmem"), "built_rss_mb": built_rss,
              "model_mb": model_bytes / 2**20}  # fmt: skip
    return {
        "contender": contender.name,
        "pid": os.getpid(),
        "driver_threads": torch.get_num_threads(),
        "fit": fit,
        "metrics": _metrics(fit, home, memory),
        "model_bytes": model_bytes,
        "weights_home": home,
        # The driver's sampled peak (MB) and when it was: launch, train or return.
        "sampled_peak": {**peak, "phase": _phase(peak.get("time"), clock)} if peak else None,
    }


def main(argv: list[str] | None = None) -> None:
    measurement_main(argv, __doc__, CONTENDERS, ShardedSpec, measure)


if __name__ == "__main__":
    main()
