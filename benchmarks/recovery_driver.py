"""One restart-benchmark measurement: a fresh driver process runs one case's fit and writes what it saw.

    python -m benchmarks.recovery_driver --contender ray --spec spec.json --result result.json

Started by :mod:`benchmarks.recovery`, once per case and repeat. The driver connects to the
harness's Ray cluster before any timer starts, then fits :class:`BenchModule` for ``spec.epochs``
epochs of ``spec.steps`` steps (recovery cases: rank ``spec.kill_rank`` SIGKILLs itself once, after
optimizer step ``spec.kill_step``) or ``spec.cadence_epochs`` epochs of ``spec.cadence_steps`` steps
(cadence cases, no failure; RayStrategy, or RayFSDPStrategy in the ``fsdp_`` cases).

Every process is on one machine, so the times that rank 0 and the killed rank write to files compare
with each other and with the driver's ``time.time()``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import psutil

from benchmarks.measure import _fit_metrics, measurement_main
from benchmarks.workload import BenchModule, Spec, StepClock, pl, ray_train_trainer, read_clock, trainer_kwargs


@dataclass
class RecoverySpec(Spec):
    """:class:`~benchmarks.workload.Spec` plus the failure and the epochs; ``steps``: optimizer steps per epoch."""

    steps: int = 40
    epochs: int = 3  # of a recovery fit
    kill_step: int = 70  # the killed rank dies after this optimizer step (mid-epoch, after a checkpoint)
    kill_rank: int = 1
    every_n: int = 20  # recovery_checkpoint_every_n_steps of the "every N steps" cases
    cadence_epochs: int = 6  # of a cadence fit
    cadence_steps: int = 100  # optimizer steps per epoch of a cadence fit

    @classmethod
    def tiny(cls) -> RecoverySpec:
        """Every code path in seconds of compute."""
        sizes = asdict(Spec.tiny())
        return cls(**{**sizes, "steps": 8}, kill_step=14, every_n=4, cadence_epochs=3, cadence_steps=8)

    def shape(self, part: str) -> tuple[RecoverySpec, int]:
        """The sizes (``steps`` per epoch) and the epochs of a fit of the ``part`` ("recovery" or "cadence")."""
        if part == "recovery":
            return self, self.epochs
        return replace(self, steps=self.cadence_steps), self.cadence_epochs

    def checkpoint_steps(self, every_n: int | None, part: str) -> list[int]:
        """The optimizer steps after which a recovery checkpoint is taken (epoch ends; every ``every_n`` steps)."""
        spec, epochs = self.shape(part)
        per_epoch, total = spec.steps, spec.steps * epochs
        ends = set(range(per_epoch, total + 1, per_epoch))
        # As RayStrategy does: no step checkpoint on an epoch's last batch (the epoch's own follows).
        return sorted(ends | (set(range(every_n, total + 1, every_n)) if every_n else set()))


@dataclass(frozen=True)
class Case:
    """One way to run the fit: its name on the command line, its label in the tables."""

    name: str
    label: str
    part: str  # "recovery" or "cadence"
    ray_train: bool = False
    max_failures: int = 1
    every_n: bool = False  # a checkpoint every spec.every_n steps besides the epoch ends
    # Recovery cases: the Ray Train case with the same cadence, the ratio's denominator.
    against: str | None = None
    sharded: bool = False  # RayFSDPStrategy instead of RayStrategy
    # Cadence cases: the max_failures=0 case of the same strategy, the percentages' denominator.
    baseline: str | None = None
    # False: the survivors' state in memory is not used (the restart as before 0.6: from the newest checkpoint).
    from_memory: bool = True


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case("ray", "RayStrategy(max_failures=1), checkpoints at epoch ends", "recovery", against="ray_train"),
        Case(
            "ray_ckpt",
            "RayStrategy(max_failures=1), checkpoints at epoch ends, restarting from them (not from memory)",
            "recovery",
            against="ray_train",
            from_memory=False,
        ),
        Case(
            "ray_n",
            "RayStrategy(max_failures=1, recovery_checkpoint_every_n_steps=N)",
            "recovery",
            every_n=True,
            against="ray_train_n",
        ),
        Case(
            "ray_train",
            "Ray Train TorchTrainer, FailureConfig(max_failures=1), RayTrainReportCallback",
            "recovery",
            ray_train=True,
        ),
        Case(
            "ray_train_n",
            "Ray Train TorchTrainer, FailureConfig(max_failures=1), a report every epoch end and every N steps",
            "recovery",
            ray_train=True,
            every_n=True,
        ),
        Case("ray_mf0", "RayStrategy(max_failures=0): no recovery checkpoints", "cadence", max_failures=0),
        Case(
            "ray_mf1",
            "RayStrategy(max_failures=1): a checkpoint at every epoch end (the default)",
            "cadence",
            baseline="ray_mf0",
        ),
        Case(
            "ray_mf1_n",
            "RayStrategy(max_failures=1, recovery_checkpoint_every_n_steps=N)",
            "cadence",
            every_n=True,
            baseline="ray_mf0",
        ),
        Case(
            "fsdp_mf0",
            "RayFSDPStrategy(max_failures=0): sharded, no recovery checkpoints",
            "cadence",
            max_failures=0,
            sharded=True,
        ),
        Case(
            "fsdp_mf1",
            "RayFSDPStrategy(max_failures=1): sharded, a checkpoint at every epoch end (the default)",
            "cadence",
            sharded=True,
            baseline="fsdp_mf0",
        ),
    )
}


def _append(path: str, record: dict[str, Any]) -> None:
    """One JSON line, written with one ``write`` (O_APPEND): the file survives a SIGKILL of any writer."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_lines(path: str) -> list[dict[str, Any]]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class KillOnce(pl.Callback):
    """Rank ``rank`` SIGKILLs its own process after optimizer step ``step``, the first time only.

    ``marker`` records the kill (time and step) before it happens, and keeps a restarted rank alive.
    Rank 0 appends each attempt's start (the step it resumed from) and the fit's end to ``attempts``.
    """

    def __init__(self, step: int | None, rank: int, marker: str, attempts: str) -> None:
        self.step, self.rank, self.marker, self.attempts = step, rank, marker, attempts

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            started = psutil.Process().create_time()  # when this process started: splits a restart's time
            record = {
                "t": time.time(),
                "global_step": trainer.global_step,
                "pid": os.getpid(),
                "process_started": started,
            }
            _append(self.attempts, {"event": "start", **record})

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step or os.path.exists(self.marker):
            return
        _append(self.marker, {"t": time.time(), "global_step": trainer.global_step, "pid": os.getpid()})
        os.kill(os.getpid(), signal.SIGKILL)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            _append(self.attempts, {"event": "end", "t": time.time(), "global_step": trainer.global_step})


class EveryNSteps(pl.Callback):
    """Calls ``action(trainer, module)`` after every ``n``-th optimizer step but an epoch's last, as
    RayStrategy's ``recovery_checkpoint_every_n_steps`` does: Ray Train's report of the same cadence."""

    def __init__(self, n: int, action: Callable[[pl.Trainer, pl.LightningModule], None]) -> None:
        self.n, self.action = n, action

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step % self.n == 0 and not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self.action(trainer, pl_module)


@dataclass(frozen=True)
class Paths:
    """The files of one measurement (rank 0's clock, the kill marker, rank 0's attempts)."""

    clock: str
    marker: str
    attempts: str

    @classmethod
    def under(cls, result_path: str) -> Paths:
        return cls(result_path + ".clock", result_path + ".kill", result_path + ".attempts")


def _callbacks(spec: RecoverySpec, paths: Paths, kill: bool) -> list[pl.Callback]:
    step = spec.kill_step if kill else None
    return [StepClock(paths.clock), KillOnce(step, spec.kill_rank, paths.marker, paths.attempts)]


def _trainer_arguments(spec: Spec, epochs: int) -> dict[str, Any]:
    return {**trainer_kwargs(spec, spec.steps), "max_epochs": epochs}


def _ray_lightning_fit(spec: RecoverySpec, case: Case, paths: Paths) -> dict[str, Any]:
    from ray_lightning import RayFSDPStrategy, RayStrategy

    sizes, epochs = spec.shape(case.part)
    every_n = {"recovery_checkpoint_every_n_steps": spec.every_n} if case.every_n else {}
    # RayFSDPStrategy shards BenchModule itself (its `net` one FSDP unit) before configure_optimizers runs.
    kind = RayFSDPStrategy if case.sharded else RayStrategy
    if not case.from_memory:
        RayStrategy.state_in_every_rank = False  # this driver process's fits: the survivors' state is not used
    strategy = kind(num_workers=spec.workers, max_failures=case.max_failures, **every_n)
    trainer = pl.Trainer(
        **_trainer_arguments(sizes, epochs),
        strategy=strategy,
        callbacks=_callbacks(spec, paths, case.part == "recovery"),
    )
    trainer.fit(BenchModule(sizes))
    # trainer.strategy: a lightning.pytorch Trainer runs a copy of the strategy given (rebuilt for its namespace).
    restarts = [{**asdict(r), "cause": r.cause[:200]} for r in trainer.strategy.restarts]
    return {"driver_global_step": trainer.global_step, "restarts": restarts}


def _ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: resumes from ``ray.train.get_checkpoint()`` through ``ckpt_path``."""
    import ray.train
    from ray.train.lightning import RayTrainReportCallback

    spec, paths = RecoverySpec.from_json(config["spec"]), Paths(**config["paths"])
    report = RayTrainReportCallback()  # saves and reports a checkpoint at every epoch end
    callbacks = [*_callbacks(spec, paths, kill=True), report]
    if config["every_n"]:
        callbacks.append(EveryNSteps(spec.every_n, report.on_train_epoch_end))
    trainer = ray_train_trainer(_trainer_arguments(spec, spec.epochs), callbacks)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        trainer.fit(BenchModule(spec))
        return
    with checkpoint.as_directory() as directory:
        trainer.fit(BenchModule(spec), ckpt_path=os.path.join(directory, RayTrainReportCallback.CHECKPOINT_NAME))


def _ray_train_fit(spec: RecoverySpec, case: Case, paths: Paths) -> dict[str, Any]:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"spec": spec.to_json(), "paths": asdict(paths), "every_n": case.every_n},
        scaling_config=ScalingConfig(num_workers=spec.workers, use_gpu=False),
        run_config=RunConfig(
            storage_path=os.path.join(spec.scratch, "ray_train"),
            name=f"recovery-{uuid.uuid4().hex[:8]}",
            failure_config=FailureConfig(max_failures=case.max_failures),
        ),
    )
    result = trainer.fit()
    return {"checkpoint_reported": result.checkpoint is not None}


def _back_at_kill_step(clock: dict[str, Any], back: int, kill_t: float) -> float | None:
    """When the restarted fit had the kill step's state again: its batch end, or (resumed at or past it, from the
    survivors' memory) its first step, by which it has it."""
    if back < 0:
        return clock["first_optimizer_step"] - kill_t
    return clock["batch_ends"][back] - kill_t if back < len(clock["batch_ends"]) else None


def _recovery_metrics(spec: RecoverySpec, paths: Paths, t0: float, t1: float, restarts: list[dict]) -> dict[str, Any]:
    """Kill → first step after the restart, the steps trained again, the fit's time and end, from the files."""
    kills = read_lines(paths.marker)
    if not kills:
        raise RuntimeError(f"rank {spec.kill_rank} never reached step {spec.kill_step}: no kill was recorded")
    kill_t, kill_step = kills[0]["t"], kills[0]["global_step"]
    records = read_lines(paths.attempts)
    starts = [r for r in records if r["event"] == "start"]
    ends = [r for r in records if r["event"] == "end"]
    clock = read_clock(paths.clock)  # written by the last attempt's rank 0 at its on_fit_end
    resumed = starts[-1]["global_step"]
    back = kill_step - resumed - 1  # the index of the kill step among the last attempt's batch ends
    return {
        "recovery_s": clock["first_optimizer_step"] - kill_t,
        "detect_s": restarts[0]["failed_at"] - kill_t if restarts else None,
        "new_process_s": starts[-1]["process_started"] - kill_t,
        "relaunch_s": clock["fit_start"] - kill_t,
        "work_lost_steps": kill_step - resumed,
        "back_at_kill_step_s": _back_at_kill_step(clock, back, kill_t),
        "fit_s": t1 - t0,
        "final_global_step": ends[-1]["global_step"] if ends else None,
        "attempts": len(starts),
        "resumed_step": resumed,
        "kill_step": kill_step,
    }


def _cadence_metrics(spec: RecoverySpec, case: Case, t0: float, t1: float, clock: dict[str, Any]) -> dict[str, Any]:
    """Step times of a fit without failures: the median, and means over whole epochs that include every checkpoint."""
    sizes, epochs = spec.shape("cadence")
    per_epoch = sizes.steps
    ends, cpu = clock["batch_ends"], clock["batch_end_cpu"]
    if len(ends) != per_epoch * epochs:
        raise RuntimeError(f"rank 0 ran {len(ends)} steps, not {per_epoch * epochs}")
    # The window: epochs 2.. (the first is the warm-up), from the first epoch's last batch end: one
    # epoch end per `per_epoch` steps, and each checkpoint's cost lands in the interval after its step.
    first, last, steps = per_epoch - 1, per_epoch * epochs - 1, per_epoch * (epochs - 1)
    every_n = spec.every_n if case.every_n else None
    taken = spec.checkpoint_steps(every_n, "cadence") if case.max_failures else []
    base = _fit_metrics(sizes, t0, t1, clock)
    # The step after each epoch end: where the default cadence's checkpoint lands (and the data loader restarts).
    boundary_s = statistics.median(ends[e * per_epoch] - ends[e * per_epoch - 1] for e in range(1, epochs))
    return {
        "step_ms": base["step_s"] * 1000,
        "mean_step_ms": (ends[last] - ends[first]) / steps * 1000,
        "mean_step_cpu_ms": (cpu[last] - cpu[first]) / steps * 1000,
        "epoch_boundary_ms": boundary_s * 1000,
        # What an epoch end adds to a step: the data loader's restart, and the checkpoint where there is one.
        "epoch_end_excess_ms": (boundary_s - base["step_s"]) * 1000,
        "checkpoints_in_window": sum(1 for s in taken if per_epoch <= s <= last),
        "steps_in_window": steps,
        "fit_s": base["wall_s"],
        "final_global_step": len(ends),
    }


def measure(case: Case, spec: RecoverySpec, result_path: str, record: bool = True) -> dict[str, Any]:
    """Connect to the harness's cluster, run the case's fit, return its metrics (``record``: unused here)."""
    import ray

    ray.init(address=spec.ray_address, log_to_driver=True)
    paths = Paths.under(result_path)
    fit = _ray_train_fit if case.ray_train else _ray_lightning_fit
    t0 = time.time()
    extra = fit(spec, case, paths)
    t1 = time.time()
    if case.part == "recovery":
        metrics = _recovery_metrics(spec, paths, t0, t1, extra.get("restarts", []))
    else:
        metrics = _cadence_metrics(spec, case, t0, t1, read_clock(paths.clock))
    return {"contender": case.name, "pid": os.getpid(), "metrics": metrics, **extra}


def main(argv: list[str] | None = None) -> None:
    measurement_main(argv, __doc__, CASES, RecoverySpec, measure)


if __name__ == "__main__":
    main()
