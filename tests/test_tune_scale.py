"""ray_lightning.tune at scale: PBT/PB2 exploits that resume inside ``fit`` with the mutated settings,
schedulers that free what they stop, and trials that start on the workers of the trial before."""

from __future__ import annotations

import os
import time

import pytest
import pytorch_lightning as pl
import torch
from ray import tune
from ray.tune.schedulers import ASHAScheduler, PopulationBasedTraining
from ray.util.placement_group import placement_group_table

from ray_lightning import RayStrategy
from ray_lightning.tune import TuneReportCallback, TuneReportCheckpointCallback, get_tune_resources
from tests.conftest import alive_worker_actors, wait_for, wait_for_no_placement_groups
from tests.models import BoringModel

pytestmark = pytest.mark.usefixtures("ray_local")

STEPS_PER_EPOCH = 4  # 64 samples, batch 8, 2 workers


def _trainer(callbacks, max_epochs: int, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=max_epochs,
        strategy=RayStrategy(num_workers=2),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


class SearchedModel(BoringModel):
    """SGD with momentum; logs what its fit started from and what its optimizer holds."""

    def __init__(self, lr: float, momentum: float = 0.9) -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)

    def on_train_start(self):
        optimizer = self.trainer.optimizers[0]
        self.start = {
            "started_at_step": float(self.trainer.global_step),
            "started_with_weight": float(self.layer.weight.sum()),
            "started_with_momentum": float(any("momentum_buffer" in s for s in optimizer.state.values())),
        }

    def validation_step(self, batch, batch_idx):
        loss = super().validation_step(batch, batch_idx)
        self.log_dict(self.start)
        self.log("weight_now", float(self.layer.weight.sum()))
        self.log("optimizer_lr", float(self.trainer.optimizers[0].param_groups[0]["lr"]))
        self.log("hparams_lr", float(self.hparams.lr))
        self.log("step", float(self.trainer.global_step))
        return loss


def train_searched(config):
    callback = TuneReportCheckpointCallback(on="validation_end")
    # No resume code: a trial PBT restores resumes inside fit.
    _trainer([callback], max_epochs=3).fit(SearchedModel(lr=config["lr"]))


class Recorder(tune.Callback):
    """Every result Tune received (Tune's own result files of a trial that PBT restored keep only the rows
    after its checkpoint)."""

    def __init__(self) -> None:
        self.results: dict[str, list[dict]] = {}

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.results.setdefault(trial.trial_id, []).append(dict(result))


def _pbt_run(scheduler, lrs: list[float], tmp_path) -> dict[str, list[dict]]:
    recorder = Recorder()
    tuner = tune.Tuner(
        tune.with_resources(train_searched, get_tune_resources(num_workers=2)),
        param_space={"lr": tune.grid_search(lrs)},
        tune_config=tune.TuneConfig(scheduler=scheduler, metric="val_loss", mode="min", reuse_actors=True),
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0, callbacks=[recorder]),
    )
    results = tuner.fit()
    assert not results.errors, results.errors
    return recorder.results


def _check_exploits(trials: dict[str, list[dict]], expected: int) -> None:
    """The trials PBT restored went on from another trial's checkpoint, at its step, with their own lr."""
    reported = {(round(r["weight_now"], 6), int(r["step"])) for rows in trials.values() for r in rows}
    exploits = 0
    for rows in trials.values():
        for row in rows:
            # This trial's own optimizer has the lr its configuration set, whatever the checkpoint held.
            assert row["optimizer_lr"] == pytest.approx(row["hparams_lr"]), row
            # Each report's step is its iteration's: a resumed trial counts on from the checkpoint's step.
            assert row["step"] == STEPS_PER_EPOCH * row["training_iteration"], row
        restored = [r for r in rows if r["started_at_step"] > 0]
        for row in restored:
            # From weights and a step some trial reported with its checkpoint, momentum buffers included.
            assert (round(row["started_with_weight"], 6), int(row["started_at_step"])) in reported, row
            assert row["started_with_momentum"] == 1.0, row
        # Cloned at the perturbation (iteration 2) from another trial: its weights are not this trial's own.
        own = {(round(r["weight_now"], 6), int(r["step"])) for r in rows}
        exploits += any((round(r["started_with_weight"], 6), int(r["started_at_step"])) not in own for r in restored)
        assert rows[-1]["training_iteration"] == 3
    assert exploits >= expected, f"{exploits} trials continued from another trial's checkpoint, expected {expected}"


def test_pbt_exploits_resume_in_fit_with_the_mutated_learning_rate(tmp_path):
    """4 trials x 2 workers, synchronous PBT at iteration 2: the 2 worst (lr 0) clone the 2 best and
    continue from their step-8 checkpoints with a perturbed lr in their optimizers."""
    scheduler = PopulationBasedTraining(
        time_attr="training_iteration",
        perturbation_interval=2,
        hyperparam_mutations={"lr": [0.02, 0.05, 0.1]},
        quantile_fraction=0.5,
        resample_probability=1.0,
        synch=True,
    )
    trials = _pbt_run(scheduler, [0.0, 0.0, 0.05, 0.1], tmp_path)
    _check_exploits(trials, expected=2)
    finals = sorted(rows[-1]["hparams_lr"] for rows in trials.values())
    assert 0.0 not in finals, f"the lr-0 trials were not exploited: {finals}"


def test_pb2_exploit_resumes_in_fit_with_the_suggested_learning_rate(tmp_path):
    from ray.tune.schedulers.pb2 import PB2

    scheduler = PB2(
        time_attr="training_iteration",
        perturbation_interval=2,
        hyperparam_bounds={"lr": [0.01, 0.1]},
        quantile_fraction=0.5,
        synch=True,
    )
    _check_exploits(_pbt_run(scheduler, [0.0, 0.1], tmp_path), expected=1)


# -- schedulers free what they stop ----------------------------------------------------------------------------


class CountWhileRunning(tune.Callback):
    """At every result: live worker actors, placement groups, and trials running."""

    def __init__(self) -> None:
        self.samples: list[tuple[int, int, int]] = []

    def on_trial_result(self, iteration, trials, trial, result, **info):
        running = sum(t.status == "RUNNING" for t in trials)
        groups = sum(g["state"] == "CREATED" for g in placement_group_table().values())
        self.samples.append((len(alive_worker_actors()), groups, running))


class RankedModel(SearchedModel):
    """Logs ``ranked_loss``: its validation loss plus ``penalty``, so trials rank in the order the test chose."""

    def __init__(self, lr: float, penalty: float) -> None:
        super().__init__(lr=lr)
        self.penalty = penalty

    def validation_step(self, batch, batch_idx):
        loss = super().validation_step(batch, batch_idx)
        self.log("ranked_loss", loss + self.penalty, sync_dist=True)
        return loss


def train_boring(config):
    # Trial 0 trains (lr 0.1); each later one does not and ranks 1000 worse than the one before. ASHA never stops
    # the first result at a rung and stops one worse than the rung's median, so which trials it stops depends on
    # the order results arrive; with the trials started in this order, every trial after the second is worse than
    # every earlier one and is stopped, whatever the random weights and the timing (equal losses were not stopped).
    model = RankedModel(lr=0.1 if config["trial"] == 0 else 0.0, penalty=1000.0 * config["trial"])
    _trainer([TuneReportCallback({"loss": "ranked_loss"})], max_epochs=3).fit(model)


def test_asha_stops_trials_and_frees_their_workers_and_bundles(tmp_path):
    counter = CountWhileRunning()
    tuner = tune.Tuner(
        tune.with_resources(train_boring, get_tune_resources(num_workers=2)),
        param_space={"trial": tune.grid_search(list(range(6)))},
        tune_config=tune.TuneConfig(
            scheduler=ASHAScheduler(max_t=3, grace_period=1, reduction_factor=2),
            metric="loss",
            mode="min",
            # A stopped trial's fit ends at its report and its workers wait for the next trial of its actor.
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0, callbacks=[counter]),
    )
    results = tuner.fit()
    iterations = sorted(r.metrics["training_iteration"] for r in results)
    assert iterations[-1] == 3 and sum(i < 3 for i in iterations) >= 3, f"ASHA stopped too few: {iterations}"
    assert results.get_best_result().config == {"trial": 0}
    # While it ran: never more workers or groups than the trials running hold, plus one trial's just ending.
    for workers, groups, running in counter.samples:
        assert workers <= 2 * (running + 1) and groups <= running + 1, counter.samples
    wait_for(lambda: not alive_worker_actors(), 30, "the stopped trials' worker actors to be gone")
    wait_for_no_placement_groups(30, "every trial's placement group to be removed")


# -- warm trials -------------------------------------------------------------------------------------------------


class Probe(BoringModel):
    """What a trial's workers hold when its training starts."""

    def __init__(self, seed: int, started: float) -> None:
        super().__init__()
        self.save_hyperparameters()

    def on_train_start(self):
        self.probe = {
            "pid": float(os.getpid()),
            "leftover_env": float("PREVIOUS_TRIAL" in os.environ),
            "unseeded_draw": float(torch.rand(1)),
            "weight_at_start": float(self.layer.weight.sum()),
        }
        os.environ["PREVIOUS_TRIAL"] = "1"

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 0 and self.current_epoch == 0 and self.global_rank == 0:
            self.probe["start_to_first_batch_s"] = time.time() - self.hparams.started

    def training_step(self, batch, batch_idx):
        self.log_dict(self.probe, rank_zero_only=True)
        self.log("step", float(self.trainer.global_step + 1), rank_zero_only=True)
        return super().training_step(batch, batch_idx)


def train_probe(config):
    started = time.time()
    torch.manual_seed(config["seed"])
    model = Probe(config["seed"], started)
    callback = TuneReportCallback(on="train_batch_end", every=2)
    _trainer([callback], max_epochs=1).fit(model)
    torch.manual_seed(config["seed"])
    # How long Tune waits for a stopped trial's function before reusing its process: set for the user.
    waits = float(os.environ.get("TUNE_FUNCTION_THREAD_TIMEOUT_S", 2))
    tune.report({"driver_weight": float(Probe(config["seed"], started).layer.weight.sum()), "reuse_wait_s": waits})


def test_trials_tune_reuses_start_on_the_same_workers_with_nothing_left_of_the_trial_before(tmp_path):
    tuner = tune.Tuner(
        tune.with_resources(train_probe, get_tune_resources(num_workers=2)),
        param_space={"seed": tune.grid_search([1, 2, 3])},
        tune_config=tune.TuneConfig(reuse_actors=True, max_concurrent_trials=1),
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0),
    )
    results = tuner.fit()
    assert not results.errors, results.errors
    frames = [r.metrics_dataframe for r in sorted(results, key=lambda r: r.config["seed"])]
    reports = [f[f["step"].notna()] for f in frames]
    # every=2 on train_batch_end: a report at every second optimizer step of the 4.
    assert [list(r["step"]) for r in reports] == [[2.0, 4.0]] * 3
    assert len({r["pid"].iloc[0] for r in reports}) == 1, "the later trials started new workers"
    for report, frame in zip(reports, frames):
        assert report["leftover_env"].iloc[0] == 0.0
        assert report["unseeded_draw"].iloc[0] == reports[0]["unseeded_draw"].iloc[0], "random state carried over"
        assert report["weight_at_start"].iloc[0] == pytest.approx(frame["driver_weight"].dropna().iloc[0])
    assert all(f["reuse_wait_s"].dropna().iloc[0] >= 60 for f in frames), "Tune's 2 s wait left as it was"
    timings = [round(r["start_to_first_batch_s"].iloc[0], 2) for r in reports]
    print(f"trial start to rank 0's first batch (s): {timings}")
