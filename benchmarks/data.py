"""Ray Data into the training workers: samples per second with real CPU preprocessing, three ways.

    .venv/bin/python -m benchmarks.data        # from the repository root; see benchmarks/README.md

The same generated images, the same per-row preprocessing (benchmarks.data_rows.preprocess_row: a random
crop, a flip, the normalization and a blur, ~1.5 ms a row on one core), the same tiny model and 2 training
workers, fed by ray_lightning's RayDataModule under RayStrategy (the preprocessing a Ray Data map_batches), by
Ray Train (TorchTrainer(datasets=...), iter_torch_batches, RayDDPStrategy) and by a plain torch DataLoader
with loader processes in each RayStrategy worker. The harness of benchmarks.run: one local Ray cluster for the
whole run, offering the training workers' CPUs plus as many for the preprocessing as the DataLoader contender
has loader processes; round-robin over the contenders, each measurement a fresh driver process
(python -m benchmarks.data_driver). Writes ``<out>/<name>.json`` (every sample) and ``<out>/<name>.md`` and
prints the markdown.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial
from typing import Any

from benchmarks import data_report, run
from benchmarks.data_driver import CONTENDERS, TinyConvNet
from benchmarks.data_rows import DataSpec, preprocess_row

_SIZES = {
    "rows": "rows of the one epoch of a fit (12288)",
    "batch_size": "rows per batch and worker (64)",
    "warmup": "steps left out of the throughput (10)",
    "work": "blur passes per row: its preprocessing cost (24)",
    "block_rows": "rows per block of the Ray Data pipeline (256)",
    "loader_workers": "DataLoader processes per worker, and Ray Data CPUs per worker (1)",
}
_CALIBRATION_ROWS = 300


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="fresh driver processes per contender (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="training processes per fit (default 2)")
    run.add_sizes(parser, _SIZES)
    parser.add_argument(
        "--ready",
        action="store_true",
        help="the data ready before each fit (the transport alone): the Ray Data pipeline "
        "materialized in the driver, the DataLoader's rows computed in each rank's setup",
    )
    run.add_run_options(parser, CONTENDERS, "data-<start time>")
    args = run.parse_run_options(parser, argv, CONTENDERS)
    args.spec = run.sizes_of(args, DataSpec.tiny() if args.tiny else DataSpec(), _SIZES)
    args.spec.workers = args.workers
    args.spec.ready = args.ready
    if args.spec.warmup < 1 or args.spec.steps < args.spec.warmup + 2:
        parser.error(f"--rows gives {args.spec.steps} steps: need at least --warmup (>= 1) + 2")
    return args


def calibrate(spec: DataSpec, threads: int) -> dict[str, float]:
    """In this process, one thread as each training worker has: the preprocessing of one row, and a training
    step of the model on one batch (forward, backward, SGD), medians in ms. What the contenders' pipelines add
    is measured against these."""
    import numpy as np
    import torch
    from torch.nn import functional as F

    torch.set_num_threads(threads)
    rows = 20 if spec.rows < _CALIBRATION_ROWS else _CALIBRATION_ROWS
    row_s = []
    for i in range(rows):
        start = time.perf_counter()
        preprocess_row(i, spec)
        row_s.append(time.perf_counter() - start)
    model = TinyConvNet(spec)
    optimizer = model.configure_optimizers()
    x = torch.from_numpy(np.stack([preprocess_row(i, spec) for i in range(spec.batch_size)]))
    y = torch.arange(spec.batch_size) % spec.classes
    step_s = []
    for _ in range(20):
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        step_s.append(time.perf_counter() - start)
    row_ms = statistics.median(row_s) * 1000
    cpus = os.cpu_count() or 1
    return {
        "row_ms": row_ms,
        "model_step_ms": statistics.median(step_s[5:]) * 1000,
        # Every core preprocessing and nothing else: the most samples/s this machine could give.
        "preprocessing_bound_samples_per_s": cpus / row_ms * 1000,
    }


def cluster_cpus(spec: DataSpec) -> int:
    """The Ray cluster's CPUs: one per training worker, and ``loader_workers`` per worker for the preprocessing
    (Ray Data's tasks; the training workers' CPUs are reserved for them)."""
    return spec.workers * (1 + spec.loader_workers)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    spec, started = args.spec, time.time()
    calibration = calibrate(spec, run._threads_per_process(spec.workers))
    load = os.getloadavg()

    def judge(results: list, errors: list) -> dict[str, Any]:
        table = data_report.build(results, args.contenders.split(","))
        return {
            "steps": spec.steps,
            "cluster_cpus": cluster_cpus(spec),
            "calibration": calibration,
            # The machine's 1-, 5- and 15-minute load averages before and after: whether other work shared it.
            "load_average": {"before": load, "after": os.getloadavg()},
            "table": table,
            "goals": data_report.goals(table, spec.ready),
        }

    measure = partial(run._measure_all, args, spec, entry="benchmarks.data_driver", num_cpus=cluster_cpus(spec))
    return run.benchmark(args, argv, "data", measure, judge, data_report.markdown, started=started)


if __name__ == "__main__":
    run.entry(main)
