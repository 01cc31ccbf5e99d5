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
import os
import signal
import sys
import time

from benchmarks import fabric_report, run
from benchmarks.fabric_load import OtherLoad
from benchmarks.fabric_measure import CONTENDERS
from benchmarks.fabric_workload import FabricSpec

_SIZES = ("workers", "steps", "warmup", "batch_size", "hidden")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="fresh driver processes per contender (default 3)")
    parser.add_argument("--workers", type=int, default=None, help="training processes per launch (2)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per launch (300)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the step time (30)")
    parser.add_argument("--batch-size", type=int, default=None, help="per worker (128)")
    parser.add_argument("--hidden", type=int, default=None, help="width of the MLP's hidden layers (384)")
    run.add_run_options(parser, CONTENDERS, "fabric-<start time>")
    args = run.parse_run_options(parser, argv, CONTENDERS)
    args.spec = run.sized(FabricSpec.tiny() if args.tiny else FabricSpec(), {k: getattr(args, k) for k in _SIZES})
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    spec = args.spec
    name, out, logs = run.output_dirs(args, "fabric")
    env = run._environment(run._threads_per_process(spec.workers))
    loadavg_before = os.getloadavg()
    with OtherLoad() as load:
        started = time.time()
        results, errors = run._measure_all(args, spec, env, logs, entry="benchmarks.fabric_measure")
        ended = time.time()
    for result in results:
        result["metrics"]["other_load_cores"] = load.cores(*result["window"])
    table = fabric_report.build(results, args.contenders.split(","))
    document = {
        **run.describe(name, "benchmarks.fabric", argv, started, args.repeats, spec),
        "load": {"loadavg_before": loadavg_before, "other_cores": load.cores(started, ended), "samples": load.samples},
        "table": table,
        "targets": fabric_report.targets(table),
        "errors": errors,
        "measurements": results,
    }
    return run.publish(document, fabric_report.markdown(document), out, logs)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, run._exit_on_sigterm)
    sys.exit(main())
