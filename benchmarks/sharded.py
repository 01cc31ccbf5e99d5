"""The sharded-training benchmark: RayFSDPStrategy against Lightning's own sharded training (issue 15).

    .venv/bin/python -m benchmarks.sharded             # from the repository root; see benchmarks/README.md

The same harness as :mod:`benchmarks.run`: one local Ray cluster owned by this process, each
measurement a fresh driver process (:mod:`benchmarks.sharded_measure`), round-robin over the
contenders (:mod:`benchmarks.sharded_workload`), the same threads per process. Writes
``<out>/<name>.json`` (every sample) and ``<out>/<name>.md`` (:mod:`benchmarks.sharded_report`)
and prints the markdown.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

import torch

from benchmarks import run, sharded_report
from benchmarks.sharded_workload import CONTENDERS, ShardedSpec

_SIZES = ("workers", "blocks", "hidden", "features", "steps", "warmup", "batch_size")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="fresh driver processes per contender (default 3)")
    parser.add_argument("--workers", type=int, default=None, help="training processes per fit (2)")
    parser.add_argument("--blocks", type=int, default=None, help="blocks of the model (16)")
    parser.add_argument("--hidden", type=int, default=None, help="width of the blocks (1024; a block is 8 x width^2)")
    parser.add_argument("--features", type=int, default=None, help="input width (512)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per fit (12)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the step time (4)")
    parser.add_argument("--batch-size", type=int, default=None, help="per worker (16)")
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                        help="auto (default): GPUs where there is one per worker, else CPUs")  # fmt: skip
    run.add_run_options(parser, CONTENDERS, "sharded-<start time>")
    return run.parse_run_options(parser, argv, CONTENDERS)


def _spec(args: argparse.Namespace) -> ShardedSpec:
    spec = run.sized(ShardedSpec.tiny() if args.tiny else ShardedSpec(), {name: getattr(args, name) for name in _SIZES})
    gpus = torch.cuda.device_count()
    spec.gpu = args.device == "gpu" or (args.device == "auto" and gpus >= spec.workers)
    if spec.gpu and gpus < spec.workers:
        # Before the Ray cluster starts: no contender could run.
        sys.exit(
            f"benchmarks.sharded --device gpu needs {spec.workers} CUDA GPU(s), one per worker (--workers); this "
            f"machine has {gpus} (torch.cuda.is_available() is {torch.cuda.is_available()}, torch {torch.__version__})."
        )
    return spec


def _judged(args: argparse.Namespace, measured: dict[str, Any]) -> dict[str, Any]:
    """The table and the goals judged, with what was measured, skipped and failed."""
    table = sharded_report.build(measured["results"], args.contenders.split(","))
    return {
        "table": table,
        "goals": sharded_report.goals(table),
        "skipped": measured["skipped"],
        "errors": measured["errors"],
        "measurements": measured["results"],
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    spec = _spec(args)
    env = run._environment(run._threads_per_process(spec.workers))
    name, out, logs = run.output_dirs(args, "sharded")
    names = args.contenders.split(",")
    skipped = {n: why for n in names if (why := CONTENDERS[n].unavailable(spec))}
    runnable = argparse.Namespace(**{**vars(args), "contenders": ",".join(n for n in names if n not in skipped)})
    started = time.time()
    results, errors = run._measure_all(runnable, spec, env, logs, entry="benchmarks.sharded_measure")
    measured = {"results": results, "errors": errors, "skipped": skipped}
    document = {
        **run.describe(name, "benchmarks.sharded", argv, started, args.repeats, spec),
        **_judged(args, measured),
    }
    return run.publish(document, sharded_report.markdown(document), out, logs)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, run._exit_on_sigterm)
    sys.exit(main())
