"""Rank 0 off the driver's machine writes under a staging directory; its files come back to the driver's paths.

These tests fail when Lightning renames the attributes ray_lightning.home.files rewrites.
"""

from __future__ import annotations

import os

import pytest
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

from ray_lightning.home import files as driver_files
from ray_lightning.home import landing
from ray_lightning.home.outbox import Outbox


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
    scope = landing.WriteScope.of(trainer)
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
    files = driver_files.collect(staging, Outbox(None))
    assert files == {best[len(staging) :]: b"weights"}
    assert landing.write(files, scope) == [best[len(staging) :]]
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

    files = driver_files.collect(str(staging), Outbox(None))
    assert files == {str(driver_dir / "run-2" / "logs" / "debug.log"): b"rank 0's log"}

    # On the driver, debug.log links to an earlier run's log, which must survive the write.
    earlier = driver_dir / "run-1" / "logs" / "debug.log"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("the driver's log")
    (driver_dir / "debug.log").symlink_to(earlier)
    landing.write({str(driver_dir / "debug.log"): b"new"}, landing.WriteScope((os.path.realpath(driver_dir),)))
    assert earlier.read_text() == "the driver's log"
    assert not (driver_dir / "debug.log").is_symlink() and (driver_dir / "debug.log").read_text() == "new"


def test_the_staging_directory_is_private_to_its_user(tmp_path):
    import stat

    previous = os.umask(0o002)  # a permissive umask must not make it group-readable
    try:
        staging = str(tmp_path / "ray_lightning-staging-abc")
        driver_files.stage(_trainer(), staging)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(staging).st_mode) == 0o700
    # A directory someone made first, open to others, is not written into.
    taken = tmp_path / "ray_lightning-staging-taken"
    taken.mkdir(mode=0o777)
    os.chmod(taken, 0o777)
    with pytest.raises(PermissionError, match=f"staging directory {taken} already exists and is not a private"):
        driver_files.stage(_trainer(), str(taken))
    # Nor a symbolic link to somewhere else.
    link = tmp_path / "ray_lightning-staging-link"
    link.symlink_to(staging)
    with pytest.raises(PermissionError, match="is not a private directory"):
        driver_files.stage(_trainer(), str(link))


def test_the_driver_writes_only_where_its_trainer_writes(tmp_path, caplog):
    trainer = _trainer(default_root_dir="runs")
    driver_files.make_absolute(trainer)
    scope = landing.WriteScope.of(trainer)
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "escape").symlink_to(home)  # a link inside the run directory to outside it
    sent = {
        str(tmp_path / "runs" / "lightning_logs" / "version_0" / "metrics.csv"): b"ok",
        str(tmp_path / "ckpts" / "epoch=0.ckpt"): b"ok",
        str(tmp_path / "runs" / ".." / "home" / ".bashrc"): b"evil",
        str(tmp_path / "runs" / "escape" / ".profile"): b"evil",
        str(home / ".bashrc"): b"evil",
        "../home/.bashrc": b"evil",
    }
    with caplog.at_level("WARNING", logger="ray_lightning.home.landing"):
        written = landing.write(sent, scope)
    assert written == sorted(
        [
            str(tmp_path / "ckpts" / "epoch=0.ckpt"),
            str(tmp_path / "runs" / "lightning_logs" / "version_0" / "metrics.csv"),
        ]
    )
    assert list(home.iterdir()) == []
    refused = [r.getMessage() for r in caplog.records if r.name == "ray_lightning.home.landing"]
    assert len(refused) == 4 and all("ray_lightning: refused to write" in m for m in refused)
    assert any(str(home / ".bashrc") in m for m in refused) and any("escape/.profile" in m for m in refused)


def test_checkpoints_the_workers_own_callbacks_name_are_written_anywhere(tmp_path, caplog):
    # configure_callbacks' ModelCheckpoint(dirpath="/data/ckpts") writes where it likes: the files
    # its state names come back, other files there do not.
    scope = landing.WriteScope.of(pl.Trainer(default_root_dir=str(tmp_path / "runs"), logger=False))
    elsewhere = tmp_path / "data" / "ckpts"
    best, last = str(elsewhere / "epoch=1.ckpt"), str(elsewhere / "last.ckpt")
    state = {"dirpath": str(elsewhere), "best_k_models": {best: 0.1}, "best_model_path": best, "last_model_path": last}
    claimed = {**state, "best_model_path": str(tmp_path / ".bashrc")}  # not a checkpoint file
    scope = scope.with_checkpoints([("ModelCheckpoint{...}", state), ("Other", claimed), ("Plain", {"x": 1})])
    sent = {best: b"1", last: b"2", str(elsewhere / "notes.txt"): b"3", str(tmp_path / ".bashrc"): b"4"}
    with caplog.at_level("WARNING", logger="ray_lightning.home.landing"):
        assert landing.write(sent, scope) == [best, last]
    assert not (tmp_path / ".bashrc").exists()
    assert len([r for r in caplog.records if r.name == "ray_lightning.home.landing"]) == 2


def test_a_fabric_functions_staged_files_land_at_the_paths_it_gave(tmp_path):
    # Without a Trainer (fabric.launch) only fabric.save and the loggers stage: they come home where the
    # function said, after it returned and after a failure alike (launch.launcher), wherever that is.
    scope = landing.WriteScope.of(None)
    sent = {str(tmp_path / "ckpt" / "last.ckpt"): b"1", str(tmp_path / "elsewhere" / "metrics.csv"): b"2"}
    assert landing.write(sent, scope) == sorted(sent)
    assert (tmp_path / "ckpt" / "last.ckpt").read_bytes() == b"1"


def test_a_staged_checkpoint_state_outside_the_trainers_directories_is_not_loaded(tmp_path, caplog):
    from pytorch_lightning.callbacks import ModelCheckpoint

    from ray_lightning.home.results import WorkerOutput, apply_to_driver

    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"))
    trainer = pl.Trainer(callbacks=[checkpoint], logger=False, default_root_dir=str(tmp_path))
    scope = landing.WriteScope.of(trainer)
    outside = "/etc/ray_lightning-test"
    state = {"dirpath": outside, "best_k_models": {}, "best_model_path": "", "last_model_path": ""}
    output = WorkerOutput(global_rank=0, callback_states=[(checkpoint.state_key, state)], staged=True)
    with caplog.at_level("WARNING", logger="ray_lightning.home.results"):
        assert apply_to_driver(trainer, output, scope) == []
    # Its dirpath would have widened the next call's scope.
    assert checkpoint.dirpath == str(tmp_path / "ckpts")
    assert "ignored the state of ModelCheckpoint" in caplog.text and outside in caplog.text
