"""ray_lightning.tune: real Ray Tune runs whose trials each train on several real Ray workers."""

from __future__ import annotations

import asyncio
import json
import os
import re

import pytest
import pytorch_lightning as pl
import ray
import torch
from ray import tune

from ray_lightning import HorovodRayStrategy, RayStrategy
from ray_lightning.tune import TuneReportCallback, TuneReportCheckpointCallback, get_tune_resources
from tests.conftest import alive_worker_actors, wait_for
from tests.models import BoringModel, EpochsTrained

pytestmark = pytest.mark.usefixtures("ray_local")


def _trainer(callbacks, strategy=None, **kwargs) -> pl.Trainer:
    defaults = dict(
        max_epochs=3,
        strategy=strategy or RayStrategy(num_workers=2),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


class EpochModel(BoringModel):
    def validation_step(self, batch, batch_idx):
        self.log("epoch_seen", float(self.current_epoch))
        return super().validation_step(batch, batch_idx)


# -- arguments (no Tune run) ----------------------------------------------------------------------


def test_get_tune_resources_reserves_the_trial_and_each_worker():
    plain = get_tune_resources(num_workers=3)
    assert plain.bundles == [{"CPU": 1.0}] * 4
    assert plain.strategy == "PACK"
    mixed = get_tune_resources(
        num_workers=2, num_cpus_per_worker=2, use_gpu=True, resources_per_worker={"GPU": 0.5, "custom_accel": 1}
    )
    assert mixed.bundles == [{"CPU": 1.0}] + [{"CPU": 2.0, "GPU": 0.5, "custom_accel": 1.0}] * 2
    assert mixed.required_resources == {"CPU": 5.0, "GPU": 1.0, "custom_accel": 2.0}
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        get_tune_resources(num_workers=0)


def test_callback_arguments_are_checked_at_once():
    with pytest.raises(ValueError, match="'validaton_end' is not a Lightning callback hook.*validation_end"):
        TuneReportCallback(on="validaton_end")
    with pytest.raises(TypeError, match="metrics names must be strings"):
        TuneReportCallback(metrics={"loss": 3})
    with pytest.raises(TypeError, match=r"metrics takes None .*, a metric name, a list of names or a dict .*got 5"):
        TuneReportCallback(metrics=5)
    with pytest.raises(TypeError, match=r"`on` takes a Lightning hook name such as 'validation_end', .*got 5"):
        TuneReportCallback(on=5)
    with pytest.raises(TypeError, match=r"`on` takes a Lightning hook name .*got 5"):
        TuneReportCheckpointCallback(on=5)
    with pytest.raises(ValueError, match="relative file name"):
        TuneReportCheckpointCallback(filename="/abs/checkpoint")
    for every in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"every must be a whole number >= 1 .*got"):
            TuneReportCheckpointCallback(every=every)
    with pytest.raises(ValueError, match="ray_lightning gives its own note"):
        TuneReportCheckpointCallback(filename=".ray_lightning_tune.json")
    both = TuneReportCallback("val_loss", on=["train_epoch_end", "on_validation_end"])
    assert callable(both.on_train_epoch_end) and callable(both.on_validation_end)
    # Several reporting callbacks in one Trainer are fine (they hold no state to tell apart).
    trainer = pl.Trainer(callbacks=[both, TuneReportCallback("val_loss"), TuneReportCheckpointCallback()], logger=False)
    assert sum(isinstance(cb, TuneReportCallback) for cb in trainer.callbacks) == 3


def test_a_restored_fit_keeps_the_optimizer_settings_it_configured_otherwise_than_the_checkpoint():
    """PBT's mutated lr and weight decay win over the checkpoint's; a scheduler's decay since the start stays."""
    from types import SimpleNamespace

    from ray_lightning.tune import keep_configured_settings, optimizer_settings

    def configured(lr: float, weight_decay: float):
        weights = [torch.nn.Parameter(torch.zeros(1))]
        optimizer = torch.optim.SGD(weights, lr=lr, momentum=0.9, weight_decay=weight_decay)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return SimpleNamespace(optimizers=[optimizer], lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)])

    source = configured(lr=0.1, weight_decay=0.0)
    source_settings = optimizer_settings(source.optimizers)
    source.optimizers[0].step()
    source.lr_scheduler_configs[0].scheduler.step()  # decayed to 0.05
    trial = configured(lr=0.02, weight_decay=0.01)
    trial_settings = optimizer_settings(trial.optimizers)
    # What Lightning's restore does: the checkpoint's optimizer and scheduler states over the new ones.
    trial.optimizers[0].load_state_dict(source.optimizers[0].state_dict())
    trial.lr_scheduler_configs[0].scheduler.load_state_dict(source.lr_scheduler_configs[0].scheduler.state_dict())
    assert trial.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05)

    kept = keep_configured_settings(trial, trial_settings, source_settings)
    group = trial.optimizers[0].param_groups[0]
    assert group["lr"] == pytest.approx(0.01), "the new rate, decayed as far as the checkpoint's had been"
    assert group["weight_decay"] == 0.01 and group["momentum"] == 0.9
    assert trial.lr_scheduler_configs[0].scheduler.base_lrs == [0.02]
    assert any("lr=" in k for k in kept) and any("weight_decay=0.01" in k for k in kept)
    assert keep_configured_settings(trial, trial_settings, trial_settings) == [], "same settings: nothing to keep"


# -- Tune runs ------------------------------------------------------------------------------------


def train_boring(config, strategy_class=RayStrategy):
    metrics = {"loss": "val_loss", "epoch": "epoch_seen"}
    trainer = _trainer([TuneReportCallback(metrics)], strategy_class(num_workers=2))
    trainer.fit(EpochModel(lr=config["lr"]))


def train_with_checkpoints(config, strategy_class=RayStrategy):
    trainer = _trainer(
        [TuneReportCheckpointCallback({"loss": "val_loss"}, filename="model.ckpt")],
        strategy_class(num_workers=2),
        max_epochs=config["epochs"],
    )
    trainer.fit(BoringModel(lr=config["lr"]))


@pytest.mark.parametrize("strategy_class", [RayStrategy, HorovodRayStrategy])
def test_tuner_with_resources_reports_loadable_checkpoints(strategy_class, tmp_path):
    if strategy_class is HorovodRayStrategy:
        pytest.importorskip("horovod.torch", reason="Horovod is not installed: `python3 dev.py test` builds it")
    tuner = tune.Tuner(
        tune.with_resources(
            tune.with_parameters(train_with_checkpoints, strategy_class=strategy_class), get_tune_resources(2)
        ),
        param_space={"lr": tune.grid_search([0.01, 0.05]), "epochs": 2},
        tune_config=tune.TuneConfig(metric="loss", mode="min"),
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0),
    )
    results = tuner.fit()
    assert not results.errors
    best = results.get_best_result()
    assert best.metrics["training_iteration"] == 2
    path = os.path.join(best.checkpoint.path, "model.ckpt")
    restored = BoringModel.load_from_checkpoint(path)
    assert restored.hparams.lr == best.config["lr"]
    saved = torch.load(path, weights_only=False)
    assert saved["epoch"] == 1 and saved["optimizer_states"], "a full training checkpoint"
    assert best.metrics["loss"] == min(r.metrics["loss"] for r in results)


def train_sharded_with_checkpoints(config):
    from ray_lightning import RayFSDPStrategy
    from tests.sharded_models import MLP

    strategy = RayFSDPStrategy(num_workers=config.get("workers", 2), state_dict_type="sharded")
    callback = TuneReportCheckpointCallback({"loss": "val_loss"}, filename="model.ckpt")
    _trainer([callback, EpochsTrained(config["epochs_file"])], strategy, max_epochs=config.get("epochs", 3)).fit(MLP())


def test_a_sharded_trial_checkpoint_is_written_by_every_rank_into_tunes_folder_and_resumes_on_another_size(tmp_path):
    from ray_lightning.tune import MARKER_FILE

    first, second = tmp_path / "first-epochs", tmp_path / "second-epochs"
    analysis = tune.run(
        train_sharded_with_checkpoints,
        config={"epochs_file": str(first)},
        resources_per_trial=get_tune_resources(num_workers=2),
        storage_path=str(tmp_path),
        verbose=0,
    )
    (trial,) = analysis.trials
    assert trial.last_result["training_iteration"] == 3 and first.read_text().split() == ["0", "1", "2"]
    # Tune's checkpoint folder holds the ranks' own shards (one file per rank: never gathered) and the note Tune
    # was handed; nothing of the checkpoint went through the trial's process.
    assert sorted(os.listdir(trial.checkpoint.path)) == sorted([MARKER_FILE, "model.ckpt"])
    with open(os.path.join(trial.checkpoint.path, MARKER_FILE)) as f:
        assert json.load(f)["written_by"] == "ranks"
    folder = os.path.join(trial.checkpoint.path, "model.ckpt")
    assert sorted(f for f in os.listdir(folder) if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert torch.load(os.path.join(folder, "meta.pt"), weights_only=False)["epoch"] == 2

    # Tune restores a trial from it (as PBT's exploit does) on one worker: the shards are resharded, in place.
    restored = tune.run(
        train_sharded_with_checkpoints,
        config={"workers": 1, "epochs": 4, "epochs_file": str(second)},
        resources_per_trial=get_tune_resources(num_workers=1),
        storage_path=str(tmp_path / "again"),
        restore=trial.checkpoint.path,
        verbose=0,
    )
    (again,) = restored.trials
    assert again.status == "TERMINATED", again.error_file
    assert second.read_text().split() == ["3"]  # the resumed fit trained only the fourth epoch


def test_the_trial_process_checks_it_sees_what_the_ranks_wrote(tmp_path):
    import torch.distributed.checkpoint as dcp

    from ray_lightning.tune.trial import sees

    # What a rank on a machine that does not share Tune's local storage_path leaves: nothing, or part of it.
    full = tmp_path / "model.ckpt"
    assert not sees(str(full), sharded=False)
    torch.save({"state_dict": {}}, full)
    assert sees(str(full), sharded=False)
    folder = tmp_path / "sharded.ckpt"
    dcp.save({"state_dict": {"w": torch.ones(4)}}, checkpoint_id=str(folder))
    assert sees(str(folder), sharded=True)
    (shard,) = [p for p in folder.iterdir() if p.suffix == ".distcp"]
    shard.unlink()
    assert not sees(str(folder), sharded=True)
    assert not sees(str(tmp_path / "missing"), sharded=True)


def train_fail_once_then_resume(config):
    marker = config["dir"] + "/failed-once"
    epochs = config["dir"] + "/epochs"

    class FailOnce(EpochModel):
        def on_train_start(self):
            if self.global_rank == 0:
                with open(epochs, "a") as f:
                    f.write("start\n")

        def training_step(self, batch, batch_idx):
            if self.global_rank == 0 and batch_idx == 0:
                with open(epochs, "a") as f:
                    f.write(f"{self.current_epoch}\n")
            if self.current_epoch == 2 and not os.path.exists(marker):
                open(marker, "w").close()
                raise RuntimeError("simulated crash in epoch 2")
            return super().training_step(batch, batch_idx)

    trainer = _trainer([TuneReportCheckpointCallback({"loss": "val_loss", "epoch": "epoch_seen"})], max_epochs=4)
    # No resume code: the retried trial's fit starts from the checkpoint Tune restored it with.
    trainer.fit(FailOnce())


def test_failed_trial_resumes_from_its_last_checkpoint(tmp_path):
    analysis = tune.run(
        train_fail_once_then_resume,
        config={"dir": str(tmp_path)},
        resources_per_trial=get_tune_resources(num_workers=2),
        max_failures=1,
        storage_path=str(tmp_path / "results"),
        verbose=0,
    )
    (trial,) = analysis.trials
    assert trial.status == "TERMINATED"
    # The first attempt trained epochs 0 and 1 and crashed in epoch 2; the second went on from epoch 2.
    assert (tmp_path / "epochs").read_text().split() == ["start", "0", "1", "2", "start", "2", "3"]
    assert trial.last_result["epoch"] == 3.0
    assert trial.last_result["training_iteration"] == 4


@ray.remote(num_cpus=0)
class Meeting:
    """Trials check in here; each waits (bounded) until all expected trials are training at once."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.arrived: dict[str, str] = {}
        self.all_here = asyncio.Event()

    async def arrive(self, who: str, port: str, timeout_s: float) -> dict[str, str]:
        self.arrived[who] = port
        if len(self.arrived) >= self.expected:
            self.all_here.set()
        await asyncio.wait_for(self.all_here.wait(), timeout_s)
        return dict(self.arrived)


class CheckIn(pl.Callback):
    def __init__(self, name: str) -> None:
        self.name = name

    def on_train_start(self, trainer, pl_module):
        if trainer.is_global_zero:
            meeting = ray.get_actor("tune-meeting")
            ray.get(meeting.arrive.remote(self.name, os.environ["MASTER_PORT"], 120))


def train_concurrently(config):
    callbacks = [CheckIn(f"trial-{config['lr']}"), TuneReportCallback({"loss": "val_loss", "epoch": "epoch_seen"})]
    _trainer(callbacks).fit(EpochModel(lr=config["lr"]))


def test_two_trials_train_at_once_with_their_own_rendezvous_report_each_validation_and_the_best_wins(tmp_path):
    """Two multi-worker trials train at once (each waits for the other at its start), each meeting its
    workers at its own rendezvous; Tune gets every validation of both and finds the better config."""
    meeting = Meeting.options(name="tune-meeting").remote(2)
    try:
        analysis = tune.run(
            train_concurrently,
            config={"lr": tune.grid_search([0.0, 0.05])},
            metric="loss",
            mode="min",
            resources_per_trial=get_tune_resources(num_workers=2),
            storage_path=str(tmp_path),
            verbose=0,
        )
        assert [t.status for t in analysis.trials] == ["TERMINATED", "TERMINATED"]
        # One report per validation epoch (3), none for the sanity check.
        assert [t.last_result["training_iteration"] for t in analysis.trials] == [3, 3]
        assert [t.last_result["epoch"] for t in analysis.trials] == [2.0, 2.0]
        assert analysis.best_config == {"lr": 0.05}
        losses = {t.config["lr"]: t.last_result["loss"] for t in analysis.trials}
        assert losses[0.05] < losses[0.0]
        ports = ray.get(meeting.arrive.remote("test", "-", 1))
        assert len({ports["trial-0.0"], ports["trial-0.05"]}) == 2, ports
    finally:
        ray.kill(meeting)


def train_without_enough_resources(config):
    _trainer([TuneReportCallback()]).fit(BoringModel())


def train_reporting_a_missing_metric(config):
    _trainer([TuneReportCallback({"acc": "val_accuracy"})]).fit(BoringModel())


@pytest.mark.parametrize(
    ("train_fn", "resources", "message"),
    [
        (train_without_enough_resources, {"CPU": 1}, r"get_tune_resources\(num_workers=..."),
        (train_reporting_a_missing_metric, get_tune_resources(2), r"'val_accuracy'.*logged metrics:.*'val_loss'"),
    ],
)
def test_trial_errors_say_what_to_fix(train_fn, resources, message, tmp_path):
    tuner = tune.Tuner(
        tune.with_resources(train_fn, resources),
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0),
    )
    (result,) = tuner.fit()
    assert result.error is not None
    assert re.search(message, str(result.error), re.S), str(result.error)
    wait_for(lambda: not alive_worker_actors(), 60, "the failed trial's worker actors to be gone")


@pytest.mark.parametrize("scheduler", [[], ["--pbt"]], ids=["asha", "pbt"])
def test_tune_example_prints_the_best_hyperparameters(scheduler, tmp_path, capsys):
    from examples.tune_digits import main

    epochs = "3" if scheduler else "2"  # PBT perturbs at epoch 2
    analysis = main(["--num-samples", "2", "--max-epochs", epochs, "--storage-path", str(tmp_path), *scheduler])
    out = capsys.readouterr().out
    assert "Best hyperparameters found were: " in out
    assert set(analysis.best_config) == {"hidden", "lr", "batch_size"}
    assert "Reloaded the best checkpoint" in out
