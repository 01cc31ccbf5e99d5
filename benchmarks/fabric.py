"""The Fabric benchmark: ``Fabric(strategy=RayStrategy(...))`` against Fabric's own ``ddp_spawn``, the same loop.

    .venv/bin/python -m benchmarks.fabric          # from the repository root; see benchmarks/README.md

The harness of :mod:`benchmarks.run`: one local Ray cluster owned by this process, the same threads per
process, round-robin over the contenders, each measurement a fresh driver process
(:mod:`benchmarks.fabric_measure`) that runs ``fabric.launch`` twice: the first launch, and a second with a new
Fabric of the same strategy (RayStrategy's warm workers). The loop and its sizes: :mod:`benchmarks.fabric_workload`.
A thread of this process samples the machine's other load (:mod:`benchmarks.fabric_load`) so a busy machine
shows in the table. Writes ``<out>/<name>.json`` (every sample) and ``<out>/<name>.md``
(:mod:`benchmarks.fabric_report`) and prints the markdown.
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

from benchmarks import fabric_report, run
from benchmarks.fabric_measure import CONTENDERS
from benchmarks.fabric_workload import FabricSpec

_SIZES = {
    "workers": "training processes per launch (2)",
    "steps": "optimizer steps per launch (300)",
    "warmup": "steps left out of the step time (30)",
    "batch_size": "per worker (128)",
    "hidden": "width of the MLP's hidden layers (384)",
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="fresh driver processes per contender (default 3)")
    run.add_sizes(parser, _SIZES)
    run.add_run_options(parser, CONTENDERS, "fabric-<start time>")
    args = run.parse_run_options(parser, argv, CONTENDERS)
    args.spec = run.sizes_of(args, FabricSpec.tiny() if args.tiny else FabricSpec(), _SIZES)
    return args


def other_load(result: dict[str, Any], load: Any) -> None:
    """The machine's other load during a measurement, among its metrics (Fabric's and Tune's drivers)."""
    result["metrics"]["other_load_cores"] = load.cores(*result["window"])


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)

    def judge(results: list, errors: list) -> dict[str, Any]:
        table = fabric_report.build(results, args.contenders.split(","))
        return {"table": table, "targets": fabric_report.targets(table)}

    measure = partial(run._measure_all, args, args.spec, entry="benchmarks.fabric_measure")
    return run.benchmark(args, argv, "fabric", measure, judge, fabric_report.markdown, other_load=other_load)


if __name__ == "__main__":
    run.entry(main)
