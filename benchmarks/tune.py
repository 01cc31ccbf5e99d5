"""The Tune benchmark: a Population Based Training search, ray_lightning's Tune support against Ray Train v2 in Tune.

    .venv/bin/python -m benchmarks.tune            # from the repository root; see benchmarks/README.md

Both contenders run the same search (:mod:`benchmarks.tune_measure`): ``--trials`` trials of ``--workers`` workers
each, PBT over the learning rate every ``--interval`` reports, ``--reports`` reports of ``--steps`` optimizer steps
per trial, the whole population at once. The harness of :mod:`benchmarks.run`: one local Ray cluster owned by
this process (a logical CPU per trial process and per worker of every trial), round-robin
over the contenders, each search in a fresh driver process. A thread samples the machine's other load
(:mod:`benchmarks.fabric_load`). Writes ``<out>/<name>.json`` (every sample) and ``<out>/<name>.md``
(:mod:`benchmarks.tune_report`) and prints the markdown.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from benchmarks import run, tune_report
from benchmarks.fabric_load import OtherLoad
from benchmarks.tune_measure import CONTENDERS
from benchmarks.tune_workload import TuneSpec

_SIZES = ("workers", "trials", "reports", "steps", "interval")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="fresh driver processes (searches) per contender (2)")
    parser.add_argument("--workers", type=int, default=None, help="training processes per trial (2)")
    parser.add_argument("--trials", type=int, default=None, help="PBT's population, num_samples (4)")
    parser.add_argument("--reports", type=int, default=None, help="validation reports per trial (8)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps between two reports (60)")
    parser.add_argument("--interval", type=int, default=None, help="PBT's perturbation_interval, in reports (2)")
    run.add_run_options(parser, CONTENDERS, "tune-<start time>")
    args = run.parse_run_options(parser, argv, CONTENDERS)
    args.spec = run.sized(TuneSpec.tiny() if args.tiny else TuneSpec(), {k: getattr(args, k) for k in _SIZES})
    if args.spec.trials < 2 or args.spec.interval >= args.spec.reports:
        parser.error("PBT needs --trials 2 or more, and --interval below --reports (else nothing exploits)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    spec = args.spec
    name, out, logs = run.output_dirs(args, "tune")
    env = run._environment(run._threads_per_process(spec.workers))
    loadavg_before = os.getloadavg()
    with OtherLoad() as load:
        started = time.time()
        results, errors = run._measure_all(args, spec, env, logs, entry="benchmarks.tune_measure")
        ended = time.time()
    for result in results:
        result["metrics"]["other_load_cores"] = load.cores(*result["window"])
    table = tune_report.build(results, args.contenders.split(","))
    document = {
        **run.describe(name, "benchmarks.tune", argv, started, args.repeats, spec),
        "load": {"loadavg_before": loadavg_before, "other_cores": load.cores(started, ended), "samples": load.samples},
        "table": table,
        "targets": tune_report.targets(table),
        "errors": errors,
        "measurements": results,
    }
    return run.publish(document, tune_report.markdown(document), out, logs)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, run._exit_on_sigterm)
    sys.exit(main())
