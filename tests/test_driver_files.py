"""Rank 0 off the driver's machine writes under a staging directory; its files come back to the driver's paths.

These tests fail when Lightning renames the attributes ray_lightning.home.files rewrites.
"""

from __future__ import annotations

import os

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

from ray_lightning.home import files as driver_files


def _trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(
        logger=[CSVLogger("logs"), TensorBoardLogger("tb")],
        callbacks=[ModelCheckpoint(dirpath="ckpts")],
        enable_progress_bar=False,
        **kwargs,
    )


def test_relative_directories_become_the_drivers_absolute_ones(tmp_path):
    trainer = _trainer(default_root_dir="runs")
    driver_files.make_absolute(trainer)
    assert trainer.default_root_dir == str(tmp_path / "runs")
    csv, tb = trainer.loggers
    assert csv.log_dir == str(tmp_path / "logs" / "lightning_logs" / "version_0")
    assert tb.log_dir == str(tmp_path / "tb" / "lightning_logs" / "version_0")
    assert trainer.checkpoint_callback.dirpath == str(tmp_path / "ckpts")


def _directories(trainer: pl.Trainer) -> list[str]:
    return [trainer.default_root_dir, *(lg.log_dir for lg in trainer.loggers), trainer.checkpoint_callback.dirpath]


def test_staging_moves_every_directory_and_maps_back(tmp_path):
    trainer = _trainer()
    driver_files.make_absolute(trainer)
    driver_paths = _directories(trainer)
    staging = str(tmp_path / "staging")

    driver_files.stage(trainer, staging)

    for driver_path, staged in zip(driver_paths, _directories(trainer)):
        assert staged == staging + driver_path
        assert driver_files.from_staged(staged, staging) == driver_path

    # What rank 0 writes there comes back keyed by the driver's paths, and lands there.
    best = os.path.join(trainer.checkpoint_callback.dirpath, "epoch=0.ckpt")
    os.makedirs(os.path.dirname(best))
    with open(best, "wb") as f:
        f.write(b"weights")
    state = {"best_model_path": best, "best_k_models": {best: 0.5}}
    assert driver_files.from_staged(state, staging) == {
        "best_model_path": best[len(staging) :],
        "best_k_models": {best[len(staging) :]: 0.5},
    }
    files = driver_files.collect(staging)
    assert files == {best[len(staging) :]: b"weights"}
    driver_files.write(files)
    with open(best[len(staging) :], "rb") as f:
        assert f.read() == b"weights"


def test_remote_urls_are_left_alone(tmp_path):
    trainer = pl.Trainer(default_root_dir="s3://bucket/runs", logger=False, enable_progress_bar=False)
    driver_files.make_absolute(trainer)
    driver_files.stage(trainer, str(tmp_path))
    assert trainer.default_root_dir == "s3://bucket/runs"


def test_symbolic_links_are_neither_sent_nor_written_through(tmp_path):
    # W&B links wandb/debug.log to the latest run's log and latest-run to the run's directory.
    staging = tmp_path / "staging"
    driver_dir = tmp_path / "runs" / "wandb"
    staged_dir = staging / str(driver_dir).lstrip("/")
    (staged_dir / "run-2" / "logs").mkdir(parents=True)
    (staged_dir / "run-2" / "logs" / "debug.log").write_text("rank 0's log")
    (staged_dir / "debug.log").symlink_to(staged_dir / "run-2" / "logs" / "debug.log")
    (staged_dir / "latest-run").symlink_to(staged_dir / "run-2", target_is_directory=True)

    files = driver_files.collect(str(staging))
    assert files == {str(driver_dir / "run-2" / "logs" / "debug.log"): b"rank 0's log"}

    # On the driver, debug.log links to an earlier run's log, which must survive the write.
    earlier = driver_dir / "run-1" / "logs" / "debug.log"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("the driver's log")
    (driver_dir / "debug.log").symlink_to(earlier)
    driver_files.write({str(driver_dir / "debug.log"): b"new"})
    assert earlier.read_text() == "the driver's log"
    assert not (driver_dir / "debug.log").is_symlink() and (driver_dir / "debug.log").read_text() == "new"
