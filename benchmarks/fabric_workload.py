"""What the Fabric benchmark trains: a hand-written Fabric loop over the model and data of :mod:`benchmarks.workload`.

:func:`train` is the function every contender hands to ``fabric.launch``: it runs in each training process
(Fabric's spawned processes, or Ray actors) and returns rank 0's clock to the driver. The sizes are those of
the small-step benchmark (:class:`~benchmarks.step_measure.StepSpec`: a step of 8-9 ms with 2 workers on 2
cores), so a per-step cost shows.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from benchmarks.step_measure import StepSpec
from benchmarks.workload import BenchModule


@dataclass
class FabricSpec(StepSpec):
    """The small-step benchmark's sizes (MLP 512-384-384-16, batch 128, 300 steps, 30 of warm-up), on CPUs."""


def _process_start() -> float | None:
    """When this process was created, as ``time.time()``, from ``/proc`` (to 10 ms; psutil's ``create_time`` counts
    from a boot time in whole seconds); None where there is no ``/proc``."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except OSError:
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def train(fabric: Any, spec: FabricSpec) -> dict[str, Any] | None:
    """``spec.steps`` SGD steps of :class:`~benchmarks.workload.BenchModule` on its synthetic data, as a Fabric user
    writes them; rank 0 returns its clock, the other ranks None.

    The clock has the keys of :class:`~benchmarks.workload.StepClock`'s record, so that
    :func:`benchmarks.measure._fit_metrics` reads it: ``fit_start`` is when this function started (the processes
    are up and in their process group: Fabric joins it before calling the function), ``first_optimizer_step``
    when the first batch's forward and backward (DDP's all-reduce included) were done, ``batch_ends`` the end of
    each step (after ``optimizer.step()``), ``fit_end`` when the loop was done; and ``process_start`` and
    ``cpu_at_start``, which split the time before the function (see :func:`benchmarks.fabric_measure.launch_metrics`).
    """
    started, cpu_at_start = time.time(), time.process_time()
    module = BenchModule(spec)  # weights from spec.seed: the same in every process and contender
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    # Fabric adds a DistributedSampler: each rank gets `steps` batches of the same seeded data.
    loader = fabric.setup_dataloaders(module.train_dataloader())
    model.train()
    first_batch = first_backward = None
    batch_ends: list[float] = []
    batch_end_cpu: list[float] = []
    for x, y in itertools.islice(loader, spec.steps):
        if first_batch is None:
            first_batch = time.time()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss)
        if first_backward is None:
            first_backward = time.time()
        optimizer.step()
        batch_ends.append(time.time())
        batch_end_cpu.append(time.process_time())
    if fabric.global_rank != 0:
        return None
    return {
        "fit_start": started,
        "first_batch_start": first_batch,
        "first_optimizer_step": first_backward,
        "batch_ends": batch_ends,
        "batch_end_cpu": batch_end_cpu,
        "fit_end": time.time(),
        "world_size": fabric.world_size,
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
        # Where the time before the function went: when this process was created (a warm Ray worker's: before
        # the launch), and the CPU it had spent by the function's start (Python, imports, process group).
        "process_start": _process_start(),
        "cpu_at_start": cpu_at_start,
    }
