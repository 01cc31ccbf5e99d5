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
import signal
import sys
import time

from benchmarks import run
from benchmarks.recovery_driver import CASES, RecoverySpec
from benchmarks.recovery_report import build, markdown, targets

_SIZES = ("steps", "warmup", "epochs", "kill_step", "every_n", "cadence_epochs", "cadence_steps")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="fresh driver processes per case (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="training processes per fit (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per epoch of a recovery fit (40)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs of a recovery fit (3)")
    parser.add_argument("--kill-step", type=int, default=None, help="rank 1 dies after this optimizer step (70)")
    parser.add_argument("--every-n", type=int, default=None, help="N of the every-N-steps cases (20)")
    parser.add_argument("--cadence-steps", type=int, default=None, help="optimizer steps per epoch, cadence (100)")
    parser.add_argument("--cadence-epochs", type=int, default=None, help="epochs of a cadence fit (6)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the median step time (10)")
    run.add_run_options(parser, CASES, "recovery-<start time>")
    args = run.parse_run_options(parser, argv, CASES)
    args.spec = RecoverySpec.tiny() if args.tiny else RecoverySpec()
    args.spec.workers = args.workers
    run.sized(args.spec, {name: getattr(args, name) for name in _SIZES})
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
    spec = args.spec
    name, out, logs = run.output_dirs(args, "recovery")
    started = time.time()
    env = run._environment(run._threads_per_process(spec.workers))
    results, errors = run._measure_all(args, spec, env, logs, entry="benchmarks.recovery_driver")
    table = build(results, args.contenders.split(","), spec)
    document = {
        **run.describe(name, "benchmarks.recovery", argv, started, args.repeats, spec),
        "table": table,
        "targets": targets(table),
        "errors": errors,
        "measurements": results,
    }
    return run.publish(document, markdown(document), out, logs)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, run._exit_on_sigterm)
    sys.exit(main())
