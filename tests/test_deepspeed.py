"""RayDeepSpeedStrategy: Lightning's DeepSpeedStrategy (ZeRO) on real Ray workers, on CPUs with gloo.

DeepSpeed trains on CPUs with its CPU accelerator; its GPU run (NCCL) is in tests/test_gpu.py.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from ray_lightning import RayDeepSpeedStrategy, RayStrategy
from ray_lightning.tune import TuneReportCheckpointCallback
from tests.models import EpochsTrained
from tests.sharded_models import MLP

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (python3 dev.py test installs it)")
pytestmark = pytest.mark.usefixtures("ray_local")


def _trainer(strategy, **kwargs):
    defaults = dict(max_epochs=2, strategy=strategy, enable_progress_bar=False, enable_model_summary=False)
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


@pytest.fixture(scope="module")
def ddp_weights():
    """What DDP on 2 workers trains the MLP to: ZeRO partitions the same training."""
    pl.seed_everything(0)
    model = MLP()
    _trainer(RayStrategy(num_workers=2), logger=False, enable_checkpointing=False).fit(model)
    return model.state_dict()


@pytest.fixture(scope="module", params=[2, 3])
def zero_fit(request, tmp_path_factory):
    """A 2-epoch ZeRO fit of the MLP at stage ``request.param``, with its checkpoints: the stage's test of
    what comes home and (stage 3) the test that resumes from its checkpoint share it."""
    pl.seed_everything(0)
    model = MLP()
    directory = tmp_path_factory.mktemp(f"zero{request.param}")
    checkpoint = ModelCheckpoint(dirpath=directory / "ckpt")
    strategy = RayDeepSpeedStrategy(num_workers=2, stage=request.param)
    trainer = _trainer(strategy, logger=False, callbacks=[checkpoint])
    trainer.fit(model)
    return model, trainer, checkpoint, directory


def test_zero_trains_the_same_weights_as_ddp_and_brings_them_home(ddp_weights, zero_fit):
    model, trainer, checkpoint, directory = zero_fit
    weights = model.state_dict()
    assert all(t.numel() > 0 for t in weights.values()), "full weights on the driver, not ZeRO-3 partitions"
    torch.testing.assert_close(weights, ddp_weights)
    assert trainer.callback_metrics["val_loss"] > 0
    # DeepSpeed's checkpoint: a directory on this machine, every rank's optimizer partition in it.
    best = checkpoint.best_model_path
    parts = os.listdir(os.path.join(best, "checkpoint"))
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= set(parts), parts
    # It converts to one file with Lightning's tool, which load_from_checkpoint reads: the weights that came home.
    from pytorch_lightning.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    single = directory / "single.ckpt"
    convert_zero_checkpoint_to_fp32_state_dict(best, single)
    torch.testing.assert_close(MLP.load_from_checkpoint(single).state_dict(), weights)


@pytest.mark.parametrize("zero_fit", [3], indirect=True)
def test_a_checkpoint_resumes_training_and_the_model_tests(zero_fit):
    _, first, checkpoint, _ = zero_fit  # 2 epochs at stage 3; its checkpoint is the last epoch's
    resumed = _trainer(RayDeepSpeedStrategy(num_workers=2, stage=3), max_epochs=3, logger=False)
    model = MLP()
    resumed.fit(model, ckpt_path=checkpoint.best_model_path)
    assert first.current_epoch == 2
    assert (resumed.current_epoch, resumed.global_step) == (3, 3 * first.global_step // 2)
    # test after fit: DeepSpeed's inference engine on the same workers' device ranks.
    (result,) = resumed.test(model, verbose=False)
    assert result["test_loss"] > 0
    assert resumed.strategy.keep_workers_alive_s == 0  # every call starts new workers (DeepSpeed's globals)


@pytest.mark.parametrize("zero_fit", [3], indirect=True)
def test_a_stage_3_checkpoint_tests_on_new_workers_with_the_weights_it_holds(zero_fit):
    # trainer.test(ckpt_path=...) loads into DeepSpeed's inference engine, whose stand-in optimizer
    # lacks what DeepSpeed then calls (DeepSpeed#7272); the loss is that of the weights that came home.
    fitted, _, checkpoint, _ = zero_fit
    cpu = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    (expected,) = cpu.test(copy.deepcopy(fitted), verbose=False)
    tester = _trainer(RayDeepSpeedStrategy(num_workers=2, stage=3), logger=False)
    (result,) = tester.test(MLP(), ckpt_path=checkpoint.best_model_path, verbose=False)
    assert result["test_loss"] == pytest.approx(expected["test_loss"], rel=1e-4)


def test_a_lightning_trainer_and_the_accelerator_form():
    import lightning.pytorch as L

    from ray_lightning import RayDeepSpeedAccelerator

    trainer = L.Trainer(accelerator=RayDeepSpeedAccelerator(num_workers=2, stage=1), logger=False)
    assert isinstance(trainer.strategy, L.strategies.DeepSpeedStrategy)
    assert trainer.strategy.num_workers == 2 and trainer.strategy.config["zero_optimization"]["stage"] == 1
    trainer = pl.Trainer(strategy="deepspeed_ray", logger=False)
    assert isinstance(trainer.strategy, RayDeepSpeedStrategy)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_failures": 1}, ValueError, "cannot restart its workers"),
        ({"num_workers": (1, 2)}, ValueError, r"cannot resize \(num_workers=\(1, 2\)\)"),
        ({"stage": 4}, ValueError, "ZeRO stage"),
        ({"stge": 3}, TypeError, "did you mean 'stage'"),
        ({"process_group_backend": "nccl"}, ValueError, "use_gpu=True"),
        ({"cluster_environment": object()}, TypeError, "sets cluster_environment itself"),
    ],
)
def test_arguments_that_cannot_work_fail_in_the_constructor(kwargs, error, match):
    with pytest.raises(error, match=match):
        RayDeepSpeedStrategy(**{"num_workers": 2, **kwargs})


def test_without_deepspeed_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ImportError, match="pip install deepspeed"):
        RayDeepSpeedStrategy(num_workers=2)


def train_deepspeed_with_checkpoints(config):
    trained = EpochsTrained(config["epochs_file"], lr=True)
    callbacks = [TuneReportCheckpointCallback({"loss": "val_loss"}, filename="model.ckpt"), trained]
    strategy = RayDeepSpeedStrategy(num_workers=2, stage=2)
    _trainer(strategy, max_epochs=config["epochs"], logger=False, enable_checkpointing=False, callbacks=callbacks).fit(
        MLP(lr=config["lr"])
    )


def test_a_tune_checkpoint_is_every_ranks_part_in_tunes_folder_and_a_restored_trial_keeps_its_own_rate(tmp_path):
    from ray import tune

    from ray_lightning.tune import MARKER_FILE, get_tune_resources

    first, second = tmp_path / "first-epochs", tmp_path / "second-epochs"
    analysis = tune.run(
        train_deepspeed_with_checkpoints,
        config={"epochs_file": str(first), "epochs": 2, "lr": 0.05},
        resources_per_trial=get_tune_resources(num_workers=2),
        storage_path=str(tmp_path / "tune"),
        verbose=0,
    )
    (trial,) = analysis.trials
    assert trial.status == "TERMINATED", trial.error_file
    assert trial.last_result["training_iteration"] == 2
    assert [line.split()[0] for line in first.read_text().splitlines()] == ["0", "1"]
    # DeepSpeed's directory, each rank's ZeRO partition written by that rank into Tune's folder: nothing gathered.
    assert sorted(os.listdir(trial.checkpoint.path)) == sorted([MARKER_FILE, "model.ckpt"])
    parts = os.listdir(os.path.join(trial.checkpoint.path, "model.ckpt", "checkpoint"))
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= set(parts), parts
    # The trial process's check that it sees every rank's part: what a rank whose machine does not mount Tune's
    # storage leaves is a directory without its partition.
    partial = tmp_path / "partial"
    shutil.copytree(os.path.join(trial.checkpoint.path, "model.ckpt"), partial)
    assert RayDeepSpeedStrategy.sees_checkpoint(str(partial), 2)
    (partial / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert not RayDeepSpeedStrategy.sees_checkpoint(str(partial), 2)
    assert not RayDeepSpeedStrategy.sees_checkpoint(str(tmp_path / "missing"), 2)

    # Tune restores a trial from it with another learning rate (what PBT's exploit does): the fit resumes after
    # the second epoch and trains with the new trial's rate, not the checkpoint's.
    again = tune.run(
        train_deepspeed_with_checkpoints,
        config={"epochs_file": str(second), "epochs": 3, "lr": 0.01},
        resources_per_trial=get_tune_resources(num_workers=2),
        storage_path=str(tmp_path / "again"),
        restore=trial.checkpoint.path,
        verbose=0,
    )
    (restored,) = again.trials
    assert restored.status == "TERMINATED", restored.error_file
    assert second.read_text().split() == ["2", "0.01"]


def test_tune_checkpoints_into_a_bucket_are_refused_before_any_worker_starts(bucket, s3_endpoint, tmp_path):
    from ray import tune

    from benchmarks.storage_driver import ray_train_filesystem
    from ray_lightning.tune import get_tune_resources

    epochs = tmp_path / "epochs"
    config = {"epochs_file": str(epochs), "epochs": 1, "lr": 0.05}
    tuner = tune.Tuner(
        tune.with_resources(train_deepspeed_with_checkpoints, get_tune_resources(num_workers=2)),
        param_space=config,
        run_config=tune.RunConfig(
            storage_path=f"{bucket.name}/tune", storage_filesystem=ray_train_filesystem(s3_endpoint), verbose=0
        ),
    )
    (error,) = tuner.fit().errors
    assert "its checkpoint is a directory every rank writes its part of with local file I/O" in str(error)
    assert "storage_path must be a directory every node mounts" in str(error)
    assert not epochs.exists(), "no rank trained"
