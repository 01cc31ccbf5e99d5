"""Restarts: recovery time and work lost against Ray Train, and what the recovery checkpoints cost a step.

    .venv/bin/python -m benchmarks.recovery        # from the repository root; see benchmarks/README.md

Recovery: rank 1 SIGKILLs itself after a fixed optimizer step, mid-epoch, under RayStrategy(max_failures=1)
and under Ray Train's TorchTrainer with FailureConfig(max_failures=1), each with checkpoints at every epoch
end and, in a second pair, also every N steps. Cadence: the steady-state step of RayStrategy with
max_failures=0, with max_failures=1 (the default cadence) and with recovery_checkpoint_every_n_steps=N.

The harness of benchmarks.run: one local Ray cluster for the whole run, and round-robin over the cases
each measurement in a fresh driver process (python -m benchmarks.recovery_driver). Writes
``<out>/<name>.json`` (every sample) and ``<out>/<name>.md`` and prints the markdown.
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

from benchmarks import run
from benchmarks.recovery_driver import CASES, RecoverySpec
from benchmarks.recovery_report import build, markdown, targets

_SIZES = {
    "steps": "optimizer steps per epoch of a recovery fit (40)",
    "epochs": "epochs of a recovery fit (3)",
    "kill_step": "rank 1 dies after this optimizer step (70)",
    "every_n": "N of the every-N-steps cases (20)",
    "cadence_steps": "optimizer steps per epoch, cadence (100)",
    "cadence_epochs": "epochs of a cadence fit (6)",
    "warmup": "steps left out of the median step time (10)",
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="fresh driver processes per case (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="training processes per fit (default 2)")
    run.add_sizes(parser, _SIZES)
    run.add_run_options(parser, CASES, "recovery-<start time>")
    args = run.parse_run_options(parser, argv, CASES)
    args.spec = RecoverySpec.tiny() if args.tiny else RecoverySpec()
    args.spec.workers = args.workers
    run.sizes_of(args, args.spec, _SIZES)
    problem = _check(args.spec)
    if problem:
        parser.error(problem)
    return args


def _check(spec: RecoverySpec) -> str | None:
    """What makes the run unfair or impossible (None: nothing): the kill must fall mid-epoch, after a checkpoint."""
    per_epoch, total = spec.steps, spec.steps * spec.epochs
    if not 0 < spec.kill_rank < spec.workers:
        return f"the killed rank must be a rank other than 0 of {spec.workers} workers"
    if not per_epoch < spec.kill_step < total or spec.kill_step % per_epoch == 0:
        return f"--kill-step must fall inside an epoch after the first ({per_epoch + 1}..{total - 1}, not an epoch end)"
    if spec.kill_step in spec.checkpoint_steps(spec.every_n, "recovery"):
        return f"--kill-step {spec.kill_step} is a checkpoint step of --every-n {spec.every_n}; pick one between"
    if spec.cadence_epochs < 2 or spec.warmup >= min(per_epoch, spec.cadence_steps):
        return "a cadence fit needs 2+ epochs, and --warmup fewer steps than an epoch"
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)

    def judge(results: list, errors: list) -> dict[str, Any]:
        table = build(results, args.contenders.split(","), args.spec)
        return {"table": table, "targets": targets(table)}

    measure = partial(run._measure_all, args, args.spec, entry="benchmarks.recovery_driver")
    return run.benchmark(args, argv, "recovery", measure, judge, markdown)


if __name__ == "__main__":
    run.entry(main)
