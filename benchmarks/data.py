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
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import data_report, run
from benchmarks.data_driver import CONTENDERS, TinyConvNet
from benchmarks.data_rows import DataSpec, preprocess_row

_SIZES = ("rows", "batch_size", "warmup", "work", "block_rows", "loader_workers")
_ENTRY = "benchmarks.data_driver"
_CALIBRATION_ROWS = 300


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="fresh driver processes per contender (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="training processes per fit (default 2)")
    parser.add_argument("--rows", type=int, default=None, help="rows of the one epoch of a fit (12288)")
    parser.add_argument("--batch-size", type=int, default=None, help="rows per batch and worker (64)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the throughput (10)")
    parser.add_argument("--work", type=int, default=None, help="blur passes per row: its preprocessing cost (24)")
    parser.add_argument("--block-rows", type=int, default=None, help="rows per block of the Ray Data pipeline (256)")
    parser.add_argument(
        "--ready",
        action="store_true",
        help="the data ready before each fit (the transport alone): the Ray Data pipeline "
        "materialized in the driver, the DataLoader's rows computed in each rank's setup",
    )
    parser.add_argument("--loader-workers", type=int, default=None,
                        help="DataLoader processes per worker, and Ray Data CPUs per worker (1)")  # fmt: skip
    run.add_run_options(parser, CONTENDERS, "data-<start time>")
    args = run.parse_run_options(parser, argv, CONTENDERS)
    args.spec = run.sized(DataSpec.tiny() if args.tiny else DataSpec(), {n: getattr(args, n) for n in _SIZES})
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


def _measure_all(args: argparse.Namespace, spec: DataSpec, env: dict[str, str], logs: Path) -> tuple[list, list]:
    """Every contender ``args.repeats`` times, round-robin, each in a fresh driver process; the measurements and
    the failures."""
    names = args.contenders.split(",")
    results: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    # Short: Ray's socket paths under it must stay within the OS's limit.
    scratch = tempfile.mkdtemp(prefix="rlb-", dir="/tmp" if os.path.isdir("/tmp") else None)
    started = time.time()
    try:
        with run.ray_cluster(cluster_cpus(spec), os.path.join(scratch, "ray"), env) as address:
            spec_path = os.path.join(scratch, "spec.json")
            with open(spec_path, "w") as f:
                f.write(replace(spec, ray_address=address, scratch=scratch).to_json())
            for repeat, contender in ((r, c) for r in range(args.repeats) for c in names):
                print(f"[{time.time() - started:5.0f} s] {contender}, repeat {repeat + 1}/{args.repeats}", flush=True)
                result_path = os.path.join(scratch, f"{contender}-{repeat}.json")
                log_path = str(logs / f"{contender}-{repeat}.log")
                try:
                    result = run.measure_once(contender, spec_path, result_path, log_path, env, args.timeout, _ENTRY)
                except RuntimeError as error:
                    print(error, file=sys.stderr, flush=True)
                    errors.append({"contender": contender, "repeat": repeat, "error": str(error), "log": log_path})
                    continue
                results.append({**result, "repeat": repeat})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results, errors


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    spec = args.spec
    name, out, logs = run.output_dirs(args, "data")
    started = time.time()
    threads = run._threads_per_process(spec.workers)
    env = run._environment(threads)
    calibration = calibrate(spec, threads)
    load = os.getloadavg()
    results, errors = _measure_all(args, spec, env, logs)
    table = data_report.build(results, args.contenders.split(","))
    document = {
        **run.describe(name, "benchmarks.data", argv, started, args.repeats, spec),
        "steps": spec.steps,
        "cluster_cpus": cluster_cpus(spec),
        "calibration": calibration,
        # The machine's 1-, 5- and 15-minute load averages before and after: whether other work shared it.
        "load_average": {"before": load, "after": os.getloadavg()},
        "table": table,
        "goals": data_report.goals(table, spec.ready),
        "errors": errors,
        "measurements": results,
    }
    return run.publish(document, data_report.markdown(document), out, logs)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, run._exit_on_sigterm)
    sys.exit(main())
