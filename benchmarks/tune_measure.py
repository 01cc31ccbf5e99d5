"""One Tune-benchmark measurement: a fresh driver process runs one contender's PBT search and writes what it saw.

    python -m benchmarks.tune_measure --contender ray_lightning --spec spec.json --result result.json

Started by :mod:`benchmarks.tune`. The driver connects to the harness's cluster before any timer starts, then runs
``tune.Tuner(...).fit()`` with ``PopulationBasedTraining`` over the learning rate (the same settings for both
contenders) and times it. Each start of a trial's function appends its time to a file and rank 0 appends its
first batch's (:class:`~benchmarks.tune_workload.TrialClock`); PBT's exploits are counted from its log records.
"""

from __future__ import annotations

import logging
import os
import random
import re
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.measure import measurement_main
from benchmarks.tune_workload import TrialClock, TuneModule, TuneSpec, append_record, pl, read_records, trainer_kwargs
from benchmarks.workload import fit_from_ray_train_checkpoint, ray_train_trainer


def _trial_started(clock_path: str) -> str:
    """The first thing a trial's function does: note when it started; returns the token its rank 0 writes back."""
    from ray import tune

    token = uuid.uuid4().hex
    append_record(clock_path, {"token": token, "start": time.time(), "trial_id": tune.get_context().get_trial_id(),
                               "pid": os.getpid(), "tune_checkpoint": tune.get_checkpoint() is not None})  # fmt: skip
    return token


def ray_lightning_trial(config: dict[str, Any], spec: TuneSpec, clock_path: str) -> None:
    """A trial as a ray_lightning user writes it: plain ``trainer.fit``; RayStrategy resumes a PBT exploit from the
    trial's Tune checkpoint, which TuneReportCheckpointCallback wrote."""
    from ray_lightning import RayStrategy
    from ray_lightning.tune import TuneReportCheckpointCallback

    token = _trial_started(clock_path)
    callbacks = [
        TuneReportCheckpointCallback({"loss": "val_loss", "acc": "val_acc"}, on="validation_end"),
        TrialClock(clock_path, token),
    ]
    trainer = pl.Trainer(strategy=RayStrategy(num_workers=spec.workers), callbacks=callbacks, **trainer_kwargs(spec))
    trainer.fit(TuneModule(spec, lr=config["lr"]))


def _ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``, resuming from ``ray.train.get_checkpoint()`` as Ray's Lightning guide
    shows."""
    from ray.train.lightning import RayTrainReportCallback

    spec = TuneSpec.from_json(config["spec"])
    trainer = ray_train_trainer(
        trainer_kwargs(spec), [RayTrainReportCallback(), TrialClock(config["clock"], config["token"])]
    )
    fit_from_ray_train_checkpoint(trainer, TuneModule(spec, lr=config["lr"]))


def ray_train_trial(config: dict[str, Any], spec: TuneSpec, clock_path: str) -> None:
    """A trial as Ray documents Tune + Train v2: the function drives a ``TorchTrainer`` named after the trial (a
    restarted trial restores that Train run) and ``TuneReportCallback`` passes its reports on to Tune."""
    import ray.train
    from ray import tune
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    token = _trial_started(clock_path)
    context = tune.get_context()
    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={**config["train_loop_config"], "spec": spec.to_json(), "clock": clock_path, "token": token},
        scaling_config=ray.train.ScalingConfig(num_workers=spec.workers),
        run_config=ray.train.RunConfig(
            name=f"train-trial_id={context.get_trial_id()}",
            storage_path=os.path.join(spec.scratch, "ray_train"),
            callbacks=[TuneReportCallback()],
        ),
    )
    trainer.fit()


def _ray_lightning_trainable(spec: TuneSpec, clock_path: str) -> Any:
    from ray import tune

    from ray_lightning.tune import get_tune_resources

    trainable = tune.with_parameters(ray_lightning_trial, spec=spec, clock_path=clock_path)
    return tune.with_resources(trainable, get_tune_resources(num_workers=spec.workers))


def _ray_train_trainable(spec: TuneSpec, clock_path: str) -> Any:
    from ray import tune

    # Tune's default of 1 CPU for the function; the Train run reserves its workers itself.
    return tune.with_parameters(ray_train_trial, spec=spec, clock_path=clock_path)


@dataclass(frozen=True)
class TuneContender:
    """One way to run the search: its trainable, where the learning rate sits in its config, the metric it reports,
    and its TuneConfig's extra settings."""

    name: str
    label: str
    trainable: Callable[[TuneSpec, str], Any]
    lr_path: tuple[str, ...]
    metric: str

    def space(self, domain: Any) -> dict[str, Any]:
        """``{"lr": domain}`` nested at ``lr_path``: the param_space and PBT's hyperparam_mutations."""
        space: Any = domain
        for key in reversed(self.lr_path):
            space = {key: space}
        return space

    def lr(self, config: dict[str, Any]) -> float:
        for key in self.lr_path:
            config = config[key]
        return config  # type: ignore[return-value]


CONTENDERS: dict[str, TuneContender] = {
    c.name: c
    for c in (
        TuneContender(
            "ray_lightning",
            "ray_lightning: RayStrategy + TuneReportCheckpointCallback, get_tune_resources",
            _ray_lightning_trainable,
            ("lr",),
            "acc",
        ),
        TuneContender(
            "ray_train",
            "Ray Train v2: TorchTrainer + RayDDPStrategy in the Tune function, TuneReportCallback",
            _ray_train_trainable,
            ("train_loop_config", "lr"),
            "val_acc",
        ),
    )
}
BASELINE = "ray_train"


class PbtLog(logging.Handler):
    """Counts PBT's exploits and the exploits it skipped for want of a checkpoint, from its own log records."""

    _LOGGER = "ray.tune.schedulers.pbt"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.exploits: list[str] = []
        self.skipped: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "[Exploit] Cloning trial" in message:
            self.exploits.append(message.strip())
        elif "no checkpoint for trial" in message:
            self.skipped.append(message.strip())

    def __enter__(self) -> PbtLog:
        logger = logging.getLogger(self._LOGGER)
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        logger = logging.getLogger(self._LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self._level)


def _search(contender: TuneContender, spec: TuneSpec, clock_path: str) -> dict[str, Any]:
    """The PBT search, timed from ``Tuner.fit`` called to returned; returns the times, the trials and the log."""
    import numpy as np
    from ray import tune
    from ray.tune.schedulers import PopulationBasedTraining

    # The same initial learning rates and the same explore draws for both contenders.
    random.seed(spec.search_seed)
    np.random.seed(spec.search_seed)
    domain = tune.loguniform(spec.lr_min, spec.lr_max)
    scheduler = PopulationBasedTraining(time_attr="training_iteration", perturbation_interval=spec.interval,
                                        hyperparam_mutations=contender.space(domain))  # fmt: skip
    tune_config = tune.TuneConfig(
        metric=contender.metric,
        mode="max",
        scheduler=scheduler,
        reuse_actors=True,
        num_samples=spec.trials,
    )
    # The budget as Ray's PBT examples give it: at its last report Tune ends a trial, where PBT would pause it
    # (while another trial is paused) only to start it again with nothing left to train.
    run_config = tune.RunConfig(name=f"{contender.name}-{uuid.uuid4().hex[:6]}", storage_path=os.path.join(
        spec.scratch, "tune"), stop={"training_iteration": spec.reports}, verbose=1)  # fmt: skip
    tuner = tune.Tuner(contender.trainable(spec, clock_path), param_space=contender.space(domain),
                       tune_config=tune_config, run_config=run_config)  # fmt: skip
    t0 = time.time()
    grid = tuner.fit()
    t1 = time.time()
    trials = []
    for result in grid:
        metrics = result.metrics or {}
        error = None if result.error is None else f"{type(result.error).__name__}: {result.error}"[-3000:]
        # The trial's own id is in its directory's name: after an exploit its metrics carry the cloned trial's.
        trial_id = re.search(r"_([0-9a-f]{5}_\d{5})_", os.path.basename(result.path))
        trials.append({"trial_id": trial_id and trial_id.group(1), "acc": metrics.get(contender.metric),
                       "iterations": metrics.get("training_iteration"), "lr": contender.lr(result.config),
                       "error": error})  # fmt: skip
    global_log = os.path.join(grid.experiment_path, "pbt_global.txt")
    logged = len(read_records(global_log))
    return {"t0": t0, "t1": t1, "trials": trials, "pbt_global_lines": logged}


def trial_starts(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each start of a trial's function, in time order: trial, start, rank 0's first batch (None: it trained none),
    whether it is the trial's first start, and whether training resumed (the first batch's global step > 0)."""
    batches = {r["token"]: r for r in records if "first_batch" in r}
    seen: set[str] = set()
    starts = []
    for record in sorted((r for r in records if "start" in r), key=lambda r: r["start"]):
        batch = batches.get(record["token"])
        starts.append({
            **record,
            "first_batch": batch and batch["first_batch"],
            "start_s": batch and batch["first_batch"] - record["start"],
            "restart": record["trial_id"] in seen,
            "resumed": bool(batch and batch["global_step"] > 0),
            "rank0_pid": batch and batch["rank0_pid"],
        })  # fmt: skip
        seen.add(record["trial_id"])
    return starts


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def search_metrics(search: dict[str, Any], starts: list[dict[str, Any]], pbt_log: PbtLog) -> dict[str, Any]:
    """The table's numbers: wall time, best final accuracy, exploits, the first and the later trial starts."""
    finished = [t["acc"] for t in search["trials"] if t["error"] is None and t["acc"] is not None]
    later = starts[1:]
    return {
        "search_s": search["t1"] - search["t0"],
        "best_acc": max(finished) if finished else None,
        "exploits": len(pbt_log.exploits),
        "exploits_skipped": len(pbt_log.skipped),
        "first_start_s": starts[0]["start_s"] if starts else None,
        "later_start_s": _median([s["start_s"] for s in later]),
        "other_first_start_s": _median([s["start_s"] for s in later if not s["restart"]]),
        "restart_s": _median([s["start_s"] for s in later if s["restart"]]),
        "starts": len(starts),
        "restarts": sum(s["restart"] for s in starts),
        "resumed_starts": sum(s["resumed"] for s in starts),
    }


def measure(contender: TuneContender, spec: TuneSpec, result_path: str, record: bool) -> dict[str, Any]:
    """Run the search; return the measurement."""
    import ray

    started = time.time()
    ray.init(address=spec.ray_address, log_to_driver=True)
    clock_path = f"{result_path}.trials"
    with PbtLog() as pbt_log:
        search = _search(contender, spec, clock_path)
    starts = trial_starts(read_records(clock_path))
    return {
        "contender": contender.name,
        "pid": os.getpid(),
        "metrics": search_metrics(search, starts, pbt_log),
        "trials": search["trials"],
        "starts": starts,
        "exploit_log": pbt_log.exploits,
        "skipped_log": pbt_log.skipped,
        "pbt_global_lines": search["pbt_global_lines"],
        # When this driver measured (time.time()): the harness reads the machine's other load over it.
        "window": [started, time.time()],
    }


def main(argv: list[str] | None = None) -> None:
    measurement_main(argv, __doc__, CONTENDERS, TuneSpec, measure)


if __name__ == "__main__":
    main()
