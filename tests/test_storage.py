"""Runs in storage (``storage_path``): checkpoints and logs written by the ranks, none of it through the driver.

A real S3-compatible server (moto's server mode, tests/s3_server.py) and real Ray: DDP and the sharded
strategies' checkpoints in a bucket, rotation, restarts that read from storage, a driver killed and
run again, failed and impossible uploads, a mounted directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger

from ray_lightning import RayStrategy, RayWorkerError, release_idle_workers
from ray_lightning.errors import StorageError
from ray_lightning.home.storage import MARKER
from tests.conftest import ROOT, alive_worker_actors, session_pythonpath, wait_for
from tests.models import BoringModel
from tests.s3_server import Bucket
from tests.storage_driver import HoldsAtEpochTwo
from tests.test_restarts import FailsOnce

pytestmark = pytest.mark.usefixtures("ray_local")


def _trainer(tmp_path, strategy, **kwargs) -> pl.Trainer:
    defaults = dict(
        max_epochs=2,
        strategy=strategy,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=CSVLogger(tmp_path / "logs"),
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", save_top_k=1)],
        log_every_n_steps=1,
        default_root_dir=tmp_path,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


def _local_checkpoints(root) -> list[str]:
    return sorted(str(p) for p in root.rglob("*.ckpt"))


def test_ddp_checkpoints_and_logs_go_to_the_bucket_and_nothing_comes_home(tmp_path, bucket: Bucket, capfd):
    pl.seed_everything(0)
    model = BoringModel()
    before = model.layer.weight.detach().clone()
    strategy = RayStrategy(num_workers=2, storage_path=f"{bucket.url}/runs", run_name="ddp", max_failures=1)
    trainer = _trainer(tmp_path, strategy)
    trainer.fit(model)

    assert not torch.equal(model.layer.weight, before), "the trained weights came home"
    best = trainer.checkpoint_callback.best_model_path
    assert best.startswith(f"{bucket.url}/runs/ddp/"), best
    stored = bucket.files("runs/ddp")
    # The top-1 rotation left one checkpoint; the CSV log; the newest complete recovery checkpoint.
    assert [p for p in stored if p.endswith(".ckpt") and "/recovery/" not in p] == [
        best.removeprefix("s3://" + bucket.name + "/")
    ]
    assert any(p.endswith("metrics.csv") for p in stored), stored
    markers = [p for p in stored if p.endswith("COMPLETE.json")]
    assert len(markers) == 1, stored
    header = json.loads(bucket.fs.cat_file(f"{bucket.name}/{markers[0]}"))
    assert (header["epoch"], header["global_step"]) == (2, 8)
    assert _local_checkpoints(tmp_path) == [], "no checkpoint was written on the driver's machine"
    assert trainer.strategy.launcher.transferred_files == []
    loaded = BoringModel.load_from_checkpoint(best)
    assert loaded.hparams.lr == model.hparams.lr

    # Resumed from the best checkpoint, better ones to come: top-1 rotation would remove it (Lightning#21813).
    again = ModelCheckpoint(dirpath=os.path.dirname(best), monitor="val_loss", save_top_k=1)
    strategy = RayStrategy(num_workers=2, storage_path=f"{bucket.url}/runs", run_name="ddp-2")
    resumed = _trainer(tmp_path, strategy, max_epochs=4, callbacks=[again])
    resumed.fit(BoringModel(), ckpt_path=best)
    assert again.best_model_path != best and again.best_model_path.startswith(os.path.dirname(best))
    assert best.removeprefix(f"{bucket.url}/") in bucket.files("runs/ddp"), "the checkpoint resumed from was removed"
    assert "the fit resumed from it, so no checkpoint rotation removes it" in capfd.readouterr().err


class FailsAfterAStoredCheckpoint(FailsOnce):
    """FailsOnce, whose failing rank first waits (bounded) until a recovery checkpoint of ``run_url`` is complete:
    uploads run beside training, and the test needs one to restart from."""

    run_url = ""

    def training_step(self, batch, batch_idx):
        failing = self.global_rank == self.fail_rank and (self.current_epoch, batch_idx) == (
            self.fail_epoch,
            self.fail_batch,
        )
        if failing and not os.path.exists(self.marker):
            import fsspec

            fs, root = fsspec.core.url_to_fs(f"{self.run_url}/recovery", skip_instance_cache=True)

            def complete() -> bool:
                fs.invalidate_cache()  # s3fs keeps the listings it made
                return bool(fs.glob(f"{root}/*/{MARKER}"))

            wait_for(complete, 120, f"a complete checkpoint in {self.run_url}")
        return super().training_step(batch, batch_idx)


def _sharded_torch() -> pytest.MarkDecorator:
    from ray_lightning.namespaces import GLOO_SHARDING_TORCH, version_tuple

    return pytest.mark.skipif(
        version_tuple(torch.__version__) < GLOO_SHARDING_TORCH,
        reason=f"FSDP2 on CPUs (gloo) needs torch 2.9, this is {torch.__version__}",
    )


@_sharded_torch()
def test_fsdp_restarts_from_sharded_recovery_checkpoints_in_the_bucket_and_resumes_on_another_worker_count(
    tmp_path, bucket: Bucket
):
    from ray_lightning import RayFSDPStrategy
    from tests.sharded_models import MLP

    class FailingMLP(FailsAfterAStoredCheckpoint, MLP):
        pass

    def fsdp(**kwargs):
        return RayFSDPStrategy(num_workers=2, state_dict_type="sharded", **kwargs)

    pl.seed_everything(0)
    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / "killed").write_text("")  # nothing fails
    reference = FailingMLP(str(tmp_path / "reference" / "killed"))
    _trainer(tmp_path / "reference", fsdp(), max_epochs=3, logger=False, callbacks=[]).fit(reference)

    pl.seed_everything(0)
    model = FailingMLP(str(tmp_path / "killed"))
    model.run_url = f"{bucket.url}/fsdp"
    strategy = fsdp(max_failures=1, storage_path=bucket.url, run_name="fsdp")
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
    trainer = _trainer(tmp_path, strategy, max_epochs=3, callbacks=[checkpoints])
    trainer.fit(model)

    (restart,) = trainer.strategy.restarts
    assert (restart.rank, restart.epoch, restart.global_step) == (1, 1, 4)  # epoch 0's checkpoint, from the bucket
    assert torch.equal(model.layer[0].weight, reference.layer[0].weight)
    stored = bucket.files("fsdp")
    (marker,) = [p for p in stored if p.endswith("COMPLETE.json")]
    folder = os.path.dirname(marker)
    # Each rank wrote its own shard of the recovery checkpoint; rank 0 the rest and the marker.
    shards = sorted(os.path.basename(p) for p in stored if p.startswith(folder) and p.endswith(".distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], stored
    assert f"{folder}/meta.pt" in stored
    epoch_1 = f"{bucket.url}/fsdp/ckpt/epoch=1-step=8.ckpt"
    assert "fsdp/ckpt/epoch=1-step=8.ckpt/__1_0.distcp" in stored
    assert _local_checkpoints(tmp_path / "ckpt") == []

    # The sharded checkpoint of epoch 1 resumes on one worker, from the bucket.
    pl.seed_everything(0)
    resumed = FailingMLP(str(tmp_path / "killed"))
    one = RayFSDPStrategy(num_workers=1, storage_path=bucket.url, run_name="fsdp-one")
    again = _trainer(tmp_path / "one", one, max_epochs=3, logger=False, callbacks=[])
    again.fit(resumed, ckpt_path=epoch_1)
    # One worker takes 8 steps an epoch: epoch 2 after the 8 steps of epochs 0 and 1 (2 workers, 4 each).
    assert (again.current_epoch, again.global_step) == (3, 16)


def _driver(args: list[str], cwd) -> subprocess.Popen:
    """tests/storage_driver.py as its own driver process on the session's Ray."""
    import ray

    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address, PYTHONPATH=session_pythonpath())
    return subprocess.Popen(
        [sys.executable, "-m", "tests.storage_driver", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _markers(bucket: Bucket, prefix: str) -> list[dict]:
    found = []
    for path in bucket.files(prefix):
        if path.endswith(MARKER):
            try:
                found.append(json.loads(bucket.fs.cat_file(f"{bucket.name}/{path}")))
            except FileNotFoundError:
                continue  # the run rotated that checkpoint away between the listing and the read
    return found


def test_a_killed_driver_run_again_with_the_same_run_name_resumes_from_storage(tmp_path, bucket: Bucket):
    pl.seed_everything(0)
    reference = HoldsAtEpochTwo(hold=False)
    _trainer(tmp_path, RayStrategy(num_workers=2), max_epochs=4, logger=False, callbacks=[]).fit(reference)

    first = _driver([bucket.url, "spot", str(tmp_path / "first.pt"), "hold"], tmp_path)
    try:
        # Epoch 1's recovery checkpoint is complete (its marker is written last): then the driver dies.
        wait_for(lambda: any(m["epoch"] == 2 for m in _markers(bucket, "spot")), 240, "epoch 1's checkpoint")
        assert first.poll() is None, first.communicate()[0][-4000:]
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()

    second = _driver([bucket.url, "spot", str(tmp_path / "second.pt")], tmp_path)
    output = second.communicate(timeout=300)[0]
    assert second.returncode == 0, output[-6000:]
    assert "resuming run 'spot' from its newest complete checkpoint in storage" in output, output[-6000:]
    assert "(epoch 2, step 8)" in output
    assert "finished at epoch 4, step 16" in output
    # The same weights as the fit that was never interrupted.
    weights = torch.load(tmp_path / "second.pt")
    assert torch.equal(weights["layer.weight"], reference.layer.weight)


def test_a_failed_upload_fails_the_fit_naming_the_path(tmp_path, bucket: Bucket):
    class RemovesTheBucket(BoringModel):
        def on_train_epoch_end(self):
            if self.current_epoch == 0 and self.global_rank == 0:
                bucket.fs.rm(bucket.name, recursive=True)  # before the epoch's recovery checkpoint is written

    strategy = RayStrategy(num_workers=2, storage_path=bucket.url, run_name="gone")
    trainer = _trainer(tmp_path, strategy, max_epochs=3, logger=False, callbacks=[])
    # Epoch 0's checkpoint (ModelCheckpoint's, or the recovery checkpoint's) cannot be written.
    with pytest.raises(RayWorkerError, match=rf"writing {bucket.url}/gone/\S+ to storage failed: FileNotFoundError"):
        trainer.fit(RemovesTheBucket())


def test_a_path_the_run_cannot_write_fails_before_any_worker_starts(tmp_path, bucket: Bucket):
    before = len(alive_worker_actors())
    strategy = RayStrategy(num_workers=2, storage_path="s3://no-such-bucket-here/runs", run_name="r")
    with pytest.raises(StorageError, match=r"cannot write the run's files to s3://no-such-bucket-here/runs/r"):
        _trainer(tmp_path, strategy).fit(BoringModel())
    assert len(alive_worker_actors()) == before
    with pytest.raises(ValueError, match="fsspec knows no filesystem for 'nosuch'"):
        RayStrategy(storage_path="nosuch://x")
    with pytest.raises(ValueError, match="run_name must be one folder name"):
        RayStrategy(storage_path=str(tmp_path), run_name="a/b")


def test_a_mounted_directory_keeps_the_run_and_the_driver_refuses_a_checkpoint_without_optimizers(tmp_path):
    shared = tmp_path / "shared"
    pl.seed_everything(0)
    model = BoringModel(lr=0.01)
    checkpoint = ModelCheckpoint(monitor="val_loss", save_top_k=1)  # under default_root_dir: in the run's folder
    trainer = _trainer(tmp_path, RayStrategy(num_workers=2, storage_path=str(shared), run_name="local"),
                       callbacks=[checkpoint])  # fmt: skip
    trainer.fit(model)
    best = checkpoint.best_model_path
    assert best.startswith(str(shared / "local")) and os.path.isfile(best), best

    # The driver holds no optimizer state: once the fit's workers are gone, a full checkpoint is refused (while
    # they wait, they write it: tests/test_after_fit.py).
    release_idle_workers()
    with pytest.raises(RuntimeError, match="without the optimizers' and schedulers' states"):
        trainer.save_checkpoint(tmp_path / "driver.ckpt")
    trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
    assert torch.equal(BoringModel.load_from_checkpoint(tmp_path / "weights.ckpt").layer.weight, model.layer.weight)


@_sharded_torch()
def test_model_parallel_writes_its_shards_into_the_bucket(tmp_path, bucket: Bucket):
    from ray_lightning import RayModelParallelStrategy
    from tests.sharded_models import ShardedMLP

    pl.seed_everything(0)
    strategy = RayModelParallelStrategy(num_workers=2, storage_path=bucket.url, run_name="tp", max_failures=1)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", save_top_k=1)
    trainer = _trainer(tmp_path, strategy, logger=False, callbacks=[checkpoint])
    model = ShardedMLP()
    trainer.fit(model)
    best = checkpoint.best_model_path
    stored = bucket.files("tp")
    relative = best.removeprefix(f"{bucket.url}/")
    assert {f"{relative}/__0_0.distcp", f"{relative}/__1_0.distcp", f"{relative}/meta.pt"} <= set(stored), stored
    (marker,) = _markers(bucket, "tp")
    assert (marker["epoch"], marker["world_size"]) == (2, 2)
    tested = _trainer(tmp_path, RayModelParallelStrategy(num_workers=2, storage_path=bucket.url, run_name="tp-test"),
                      logger=False, callbacks=[]).test(ShardedMLP(), ckpt_path=best, verbose=False)  # fmt: skip
    assert tested[0]["test_loss"] == pytest.approx(trainer.callback_metrics["val_loss"].item(), rel=0.5)
    # The driver's module holds the trained weights: weights alone are one file written here.
    trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
    assert torch.load(tmp_path / "weights.ckpt", weights_only=False)["state_dict"].keys() == model.state_dict().keys()


def test_a_url_default_root_dir_is_the_storage_path(tmp_path, bucket: Bucket):
    trainer = pl.Trainer(
        max_epochs=1,
        strategy=RayStrategy(num_workers=1, run_name="rooted"),
        default_root_dir=f"{bucket.url}/root",  # Lightning's own way: its default logger and checkpoints go there
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    best = trainer.checkpoint_callback.best_model_path
    assert best.startswith(f"{bucket.url}/root/lightning_logs/version_0/checkpoints/"), best
    stored = bucket.files("root")
    assert best.removeprefix(f"{bucket.url}/") in stored
    assert any(p.startswith("root/lightning_logs/version_0/events.out.tfevents") for p in stored), stored
    assert any(p.startswith("root/rooted/recovery/") and p.endswith(MARKER) for p in stored), stored
