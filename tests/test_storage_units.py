"""The parts of ``storage_path`` that need no Ray: the settings, the uploads beside training, the markers."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from ray_lightning import RayStrategy
from ray_lightning.config.storage import StorageSettings, name_now
from ray_lightning.errors import StorageError
from ray_lightning.home import storage


def test_settings_from_arguments_and_the_environment(monkeypatch, tmp_path):
    assert StorageSettings.resolve() == StorageSettings()
    assert StorageSettings.resolve("s3://bucket/runs/", "a").path == "s3://bucket/runs"
    assert StorageSettings.resolve(f"file://{tmp_path}").path == str(tmp_path)
    assert not StorageSettings.resolve(str(tmp_path)).is_remote and StorageSettings.resolve("s3://b").is_remote
    monkeypatch.chdir(tmp_path)
    assert StorageSettings.resolve("runs").path == str(tmp_path / "runs")  # the driver's meaning of a relative path
    monkeypatch.setenv("RAY_LIGHTNING_STORAGE_PATH", "s3://from-env/x")
    monkeypatch.setenv("RAY_LIGHTNING_RUN_NAME", "nightly")
    strategy = RayStrategy(num_workers=2)
    assert (strategy.storage_path, strategy.run_name_now()) == ("s3://from-env/x", "nightly")
    monkeypatch.setenv("RAY_LIGHTNING_RUN_NAME", "a b")
    with pytest.raises(ValueError, match=r"RAY_LIGHTNING_RUN_NAME \(environment variable\) must be one folder name"):
        RayStrategy()


def test_a_default_run_name_comes_from_the_script_and_is_kept(monkeypatch):
    assert name_now("/home/alice/train model.py", now=0).startswith("train_model-19700101-")
    monkeypatch.delenv("RAY_LIGHTNING_RUN_NAME", raising=False)
    strategy = RayStrategy(storage_path="s3://b")
    assert strategy.run_name_now() == strategy.run_name_now()


def test_uploads_run_one_at_a_time_beside_the_caller_and_a_failure_names_its_path():
    uploads = storage.Uploads()
    release, order = threading.Event(), []

    def slow() -> None:
        release.wait(30)
        order.append("first")

    uploads.submit("s3://b/first", lambda: slow)
    assert order == []  # submit returned while the upload runs
    release.set()
    uploads.submit("s3://b/second", lambda: lambda: order.append("second"))  # waits for the first to end
    uploads.wait()
    assert order == ["first", "second"]

    def broken() -> None:
        raise FileNotFoundError("The specified bucket does not exist")

    uploads.submit("s3://b/third.ckpt", lambda: broken)
    with pytest.raises(StorageError, match=r"writing s3://b/third.ckpt to storage failed: FileNotFoundError"):
        uploads.submit("s3://b/fourth.ckpt", lambda: lambda: None)
    uploads.wait()  # raised once


def test_removing_a_checkpoint_does_not_wait_for_the_upload_before_it():
    uploads = storage.Uploads()
    release, order = threading.Event(), []
    uploads.submit("s3://b/new.ckpt", lambda: lambda: (release.wait(30), order.append("uploaded")))
    uploads.run_in_order("the removal of s3://b/old.ckpt", lambda: order.append("removed"))
    assert order == [] and uploads.blocked_s < 1  # ModelCheckpoint's rotation returned while the upload runs
    release.set()
    uploads.wait()
    assert order == ["uploaded", "removed"]


def test_an_abandoned_call_lets_its_uploads_go_within_a_bound():
    uploads = storage.Uploads()
    release = threading.Event()
    uploads.submit("s3://b/stuck.ckpt", lambda: lambda: release.wait(30))
    uploads.abandon(timeout_s=0.2)
    assert uploads.abandoned
    release.set()
    with pytest.raises(StorageError, match=r"the upload of s3://b/late.ckpt did not end within 0.2 s"):
        late = storage.Uploads()
        late.submit("s3://b/late.ckpt", lambda: lambda: threading.Event().wait(5))
        late.wait(timeout_s=0.2)


def test_only_a_checkpoint_with_its_marker_is_resumed_from(tmp_path):
    run = storage.Run(str(tmp_path / "run"), "run")
    assert storage.newest_complete(run) is None
    for step, complete in ((4, True), (8, True), (12, False)):  # step 12: a rank's part is missing
        folder = run.recovery_folder(step, "call-0-1")
        storage.write_bytes(storage.join(folder, storage.CHECKPOINT_FILE), b"weights")
        if complete:
            header = {"global_step": step, "epoch": step // 4, "log_step": step, "reason": "epoch boundary"}
            storage.write_marker(folder, {**header, "written_at": step, "resume_from": folder, "folder": folder})
    newest = storage.newest_complete(run)
    assert newest is not None and newest.header["global_step"] == 8
    assert json.loads((tmp_path / "run" / "recovery" / "step=000000008-call-0-1" / storage.MARKER).read_text())
    storage.remove_older_recovery(run, keep=newest.folder)
    assert sorted(p.name for p in (tmp_path / "run" / "recovery").iterdir()) == ["step=000000008-call-0-1"]


def test_a_path_that_cannot_be_written_is_refused_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StorageError, match=rf"cannot write the run's files to {blocker}/run"):
        storage.check_writable(str(blocker / "run"))


def test_a_snapshot_does_not_change_with_training():
    import collections

    import torch

    weights = torch.zeros(3)
    checkpoint = {"state_dict": collections.OrderedDict(w=weights), "optimizer_states": [{"step": 1}], "epoch": 2}
    copy = storage.snapshot(checkpoint)
    weights.add_(1.0)  # the next optimizer step
    assert torch.equal(copy["state_dict"]["w"], torch.zeros(3)) and type(copy["state_dict"]) is collections.OrderedDict
    assert copy["optimizer_states"] == [{"step": 1}] and copy["epoch"] == 2


def test_a_replicated_checkpoint_is_dealt_evenly_and_put_back_whole(tmp_path):
    """home.spread: each rank's part of a DDP recovery checkpoint, and the whole read back from the parts."""
    from collections import OrderedDict

    from ray_lightning.home import spread

    owner = spread.deal([100, 60, 50, 40, 30, 20, 5], 3)
    loads = [sum(size for size, rank in zip([100, 60, 50, 40, 30, 20, 5], owner) if rank == r) for r in range(3)]
    # Within 4/3 of an even share (largest first's bound), and the same dealing in every rank.
    assert max(loads) <= 4 / 3 * sum(loads) / 3 and min(loads) > 0
    assert spread.deal([100, 60, 50, 40, 30, 20, 5], 3) == owner

    weight, bias, running = torch.randn(4, 3), torch.randn(4), torch.randn(4)
    checkpoint = {
        "epoch": 2,
        "state_dict": OrderedDict([("layer.weight", weight), ("layer.bias", bias), ("norm.running_mean", running)]),
        "optimizer_states": [{"state": {0: {"momentum_buffer": weight * 2}, 1: {"momentum_buffer": bias * 2}},
                              "param_groups": [{"lr": 0.1, "params": [0, 1]}]}],
    }  # fmt: skip
    paths = spread._shared_paths(checkpoint, {"layer.weight", "layer.bias"})
    # The buffer (each rank updates its own) stays with the skeleton, rank 0's.
    assert ("state_dict", "norm.running_mean") not in paths and len(paths) == 4
    skeleton = spread._without(checkpoint, paths)
    assert skeleton["state_dict"]["layer.weight"] is None and torch.equal(
        skeleton["state_dict"]["norm.running_mean"], running
    )
    assert isinstance(skeleton["state_dict"], OrderedDict) and checkpoint["state_dict"]["layer.weight"] is weight

    owner = spread.deal([spread._get(checkpoint, p).numel() for p in paths], 2)
    for rank in (0, 1):
        mine = [i for i, o in enumerate(owner) if o == rank]
        part = {"paths": [list(paths[i]) for i in mine], "tensors": [spread._get(checkpoint, paths[i]) for i in mine]}
        torch.save(part, tmp_path / f"part-{rank}.pt")
    torch.save({**skeleton, "spread_over": 2}, tmp_path / spread.SKELETON)
    assert spread.is_spread(str(tmp_path)) and not spread.is_spread(str(tmp_path / "elsewhere"))

    whole = spread.load(str(tmp_path), lambda path: torch.load(path, weights_only=False))
    assert whole["epoch"] == 2 and "spread_over" not in whole
    assert torch.equal(whole["state_dict"]["layer.weight"], weight) and torch.equal(
        whole["state_dict"]["layer.bias"], bias
    )
    assert torch.equal(whole["optimizer_states"][0]["state"][1]["momentum_buffer"], bias * 2)
    assert list(whole["state_dict"]) == ["layer.weight", "layer.bias", "norm.running_mean"]
