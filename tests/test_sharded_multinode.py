"""Sharded checkpoints across nodes: every rank writes its shard on its own node, and the directory comes home whole."""

from __future__ import annotations

import os

import pytest
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

from ray_lightning import RayFSDPStrategy
from tests.conftest import connected_cluster
from tests.sharded_models import MLP


@pytest.fixture(scope="module")
def two_nodes():
    """A head the driver runs on (no worker slot) and two 1-slot nodes: every rank writes its shard elsewhere."""
    with connected_cluster(*({"num_cpus": 1, "resources": {"slot": 1}} for _ in range(2))) as cluster:
        yield cluster


def _sharded_trainer(tmp_path, num_workers, max_epochs, **kwargs):
    strategy = RayFSDPStrategy(
        num_workers=num_workers, state_dict_type="sharded", resources_per_worker={"CPU": 1, "slot": 1}
    )
    return pl.Trainer(
        max_epochs=max_epochs,
        strategy=strategy,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        **kwargs,
    )


def test_a_sharded_checkpoint_comes_home_and_resumes_on_one_and_two_workers(two_nodes, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss")
    trainer = _sharded_trainer(tmp_path, 2, 1, callbacks=[checkpoint])
    trainer.fit(MLP())
    best = checkpoint.best_model_path
    # One directory on this machine, with both ranks' shards (each written on its own node) and rank 0's metadata.
    assert os.path.isdir(best)
    assert sorted(os.listdir(best)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]

    tested = _sharded_trainer(tmp_path, 2, 1).test(MLP(), ckpt_path=best, verbose=False)[0]["test_loss"]
    on_one = _sharded_trainer(tmp_path, 1, 1).test(MLP(), ckpt_path=best, verbose=False)[0]["test_loss"]
    assert on_one == pytest.approx(tested, rel=1e-5), "the checkpoint of 2 ranks reads the same on 1"

    resumed = _sharded_trainer(tmp_path, 1, 2)
    resumed.fit(MLP(), ckpt_path=best)
    assert (resumed.current_epoch, resumed.global_step) == (2, trainer.global_step + 8)


def test_a_deepspeed_checkpoint_comes_home_whole_and_resumes(two_nodes, tmp_path):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (python3 dev.py test installs it)")
    from ray_lightning import RayDeepSpeedStrategy

    def trainer(max_epochs, **kwargs):
        strategy = RayDeepSpeedStrategy(num_workers=2, stage=2, resources_per_worker={"CPU": 1, "slot": 1})
        return pl.Trainer(max_epochs=max_epochs, strategy=strategy, enable_progress_bar=False, logger=False, **kwargs)

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt")
    first = trainer(1, callbacks=[checkpoint])
    first.fit(MLP())
    # Each rank wrote its optimizer partition on its own node; both are in the directory on this machine.
    parts = os.listdir(os.path.join(checkpoint.best_model_path, "checkpoint"))
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= set(parts), parts

    resumed = trainer(2, enable_checkpointing=False)
    resumed.fit(MLP(), ckpt_path=checkpoint.best_model_path)
    assert (resumed.current_epoch, resumed.global_step) == (2, 2 * first.global_step)


def test_a_sharded_run_in_a_bucket_survives_a_killed_worker_with_nothing_through_the_driver(
    two_nodes, tmp_path, bucket
):
    from tests.test_storage import FailsAfterAStoredCheckpoint

    class FailingMLP(FailsAfterAStoredCheckpoint, MLP):
        pass

    strategy = RayFSDPStrategy(
        num_workers=2,
        resources_per_worker={"CPU": 1, "slot": 1},
        storage_path=f"{bucket.url}/runs",
        run_name="spot",
        max_failures=1,
        state_dict_type="sharded",
    )
    trainer = pl.Trainer(
        max_epochs=3,
        strategy=strategy,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)],
        default_root_dir=tmp_path,
    )
    model = FailingMLP(str(tmp_path / "killed"))
    model.run_url = f"{bucket.url}/runs/spot"
    trainer.fit(model)

    (restart,) = trainer.strategy.restarts
    assert (restart.rank, restart.epoch, restart.global_step) == (1, 1, 4)  # from the bucket's sharded checkpoint
    assert (trainer.current_epoch, trainer.global_step) == (3, 12)
    stored = bucket.files("runs/spot")
    # Each node's rank wrote its shard of every epoch's checkpoint straight into the bucket; nothing came here.
    for step in (4, 8, 12):
        name = f"runs/spot/ckpt/epoch={step // 4 - 1}-step={step}.ckpt"
        assert {f"{name}/__0_0.distcp", f"{name}/__1_0.distcp", f"{name}/meta.pt"} <= set(stored), stored
    assert not any(tmp_path.rglob("*.distcp")) and trainer.strategy.launcher.transferred_files == []
