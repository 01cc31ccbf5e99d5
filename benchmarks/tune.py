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
from functools import partial
from typing import Any

from benchmarks import run, tune_report
from benchmarks.fabric import other_load
from benchmarks.tune_measure import CONTENDERS
from benchmarks.tune_workload import TuneSpec

_SIZES = {
    "workers": "training processes per trial (2)",
    "trials": "PBT's population, num_samples (4)",
    "reports": "validation reports per trial (8)",
    "steps": "optimizer steps between two reports (60)",
    "interval": "PBT's perturbation_interval, in reports (2)",
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="fresh driver processes (searches) per contender (2)")
    run.add_sizes(parser, _SIZES)
    run.add_run_options(parser, CONTENDERS, "tune-<start time>")
    args = run.parse_run_options(parser, argv, CONTENDERS)
    args.spec = run.sizes_of(args, TuneSpec.tiny() if args.tiny else TuneSpec(), _SIZES)
    if args.spec.trials < 2 or args.spec.interval >= args.spec.reports:
        parser.error("PBT needs --trials 2 or more, and --interval below --reports (else nothing exploits)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)

    def judge(results: list, errors: list) -> dict[str, Any]:
        table = tune_report.build(results, args.contenders.split(","))
        return {"table": table, "targets": tune_report.targets(table)}

    measure = partial(run._measure_all, args, args.spec, entry="benchmarks.tune_measure")
    return run.benchmark(args, argv, "tune", measure, judge, tune_report.markdown, other_load=other_load)


if __name__ == "__main__":
    run.entry(main)
