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
import sys
from functools import partial
from typing import Any

import torch

from benchmarks import run, sharded_report
from benchmarks.sharded_workload import CONTENDERS, ShardedSpec

_SIZES = {
    "workers": "training processes per fit (2)",
    "blocks": "blocks of the model (16)",
    "hidden": "width of the blocks (1024; a block is 8 x width^2)",
    "features": "input width (512)",
    "steps": "optimizer steps per fit (12)",
    "warmup": "steps left out of the step time (4)",
    "batch_size": "per worker (16)",
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="fresh driver processes per contender (default 3)")
    run.add_sizes(parser, _SIZES)
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                        help="auto (default): GPUs where there is one per worker, else CPUs")  # fmt: skip
    run.add_run_options(parser, CONTENDERS, "sharded-<start time>")
    return run.parse_run_options(parser, argv, CONTENDERS)


def _spec(args: argparse.Namespace) -> ShardedSpec:
    spec = run.sizes_of(args, ShardedSpec.tiny() if args.tiny else ShardedSpec(), _SIZES)
    gpus = torch.cuda.device_count()
    spec.gpu = args.device == "gpu" or (args.device == "auto" and gpus >= spec.workers)
    if spec.gpu and gpus < spec.workers:
        # Before the Ray cluster starts: no contender could run.
        sys.exit(
            f"benchmarks.sharded --device gpu needs {spec.workers} CUDA GPU(s), one per worker (--workers); this "
            f"machine has {gpus} (torch.cuda.is_available() is {torch.cuda.is_available()}, torch {torch.__version__})."
        )
    return spec


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    spec = args.spec = _spec(args)
    names = args.contenders.split(",")
    skipped = {n: why for n in names if (why := CONTENDERS[n].unavailable(spec))}
    runnable = argparse.Namespace(**{**vars(args), "contenders": ",".join(n for n in names if n not in skipped)})

    def judge(results: list, errors: list) -> dict[str, Any]:
        table = sharded_report.build(results, names)
        return {"table": table, "goals": sharded_report.goals(table), "skipped": skipped}

    measure = partial(run._measure_all, runnable, spec, entry="benchmarks.sharded_measure")
    return run.benchmark(args, argv, "sharded", measure, judge, sharded_report.markdown)


if __name__ == "__main__":
    run.entry(main)
