"""The driver's recovery folder without storage_path (ray_lightning.home.driver_disk), on the shared local Ray:
files the ranks write there in chunks appear whole, read back in ranges, and stay inside the folder.

Restarts that resume from it are in tests/test_restarts.py (DDP and FSDP2) and tests/test_restarts_multinode.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ray_lightning.errors import StorageError
from ray_lightning.home import driver_disk, storage

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture
def folder(monkeypatch):
    monkeypatch.setattr(driver_disk, "CHUNK_BYTES", 1 << 16)  # many chunks for a small file
    url = driver_disk.run_url("test-folder")
    yield url
    storage.remove(url)


def test_a_file_written_in_chunks_appears_whole_and_reads_back_in_ranges(folder):
    data = os.urandom(5 * (1 << 16) + 123)
    fs, path = storage.filesystem(f"{folder}/a/b.bin")
    with fs.open(path, "wb") as f:
        for start in range(0, len(data), 40_000):
            f.write(data[start : start + 40_000])
            assert not fs.exists(path), "half a file is visible"
    assert fs.cat_file(path) == data and fs.info(path)["size"] == len(data)
    assert fs.cat_file(path, 70_000, 70_010) == data[70_000:70_010]
    on_disk = os.path.join(driver_disk.server_folder(), "test-folder", "a", "b.bin")
    with open(on_disk, "rb") as f:  # the driver's machine holds it: this test runs there
        assert f.read() == data
    assert fs.ls(f"{folder}/a", detail=False) == [path]


def test_a_write_that_fails_leaves_no_file_and_torch_reads_what_it_saved(folder):
    fs, path = storage.filesystem(f"{folder}/broken.pt")
    with pytest.raises(RuntimeError, match="in the middle"), fs.open(path, "wb") as f:
        f.write(os.urandom(3 * (1 << 16)))  # some chunks are on the driver's disk already
        raise RuntimeError("in the middle")
    assert fs.ls(folder, detail=False) == []
    with fs.open(f"{folder}/state.pt", "wb") as f:
        torch.save({"w": torch.arange(5)}, f)
    fs.mv(f"{folder}/state.pt", f"{folder}/moved.pt")
    with fs.open(f"{folder}/moved.pt", "rb") as f:
        assert torch.equal(torch.load(f)["w"], torch.arange(5))
    storage.remove(f"{folder}/moved.pt")
    assert not fs.exists(f"{folder}/moved.pt")
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{folder}/moved.pt")


def test_paths_outside_the_folder_are_refused_and_the_server_imports_no_torch(folder):
    import ray
    from ray.util.state import list_actors

    fs, _ = storage.filesystem(folder)
    with pytest.raises(ValueError, match="outside the driver's recovery folder"):
        fs.info(f"{folder}/../../../etc/passwd")
    address = ray.get_runtime_context().gcs_address  # this test's Ray, also when others run on the machine
    (server,) = list_actors(address=address, filters=[("name", "=", driver_disk.server_name())])
    with open(f"/proc/{server.pid}/maps") as maps:
        assert "libtorch" not in maps.read(), "the server process loaded torch"


def test_a_server_that_is_gone_fails_naming_the_path(monkeypatch):
    fs = driver_disk.DriverDiskFileSystem()
    with pytest.raises(StorageError, match="ray_lightning-disk-missing on the driver.s node. is gone, for info of"):
        fs.info("rlhome://ray_lightning-disk-missing/some/file")


def test_a_new_ray_cluster_in_the_same_process_gets_a_new_folder():
    """Its first job has the same id as the last cluster's (01000000): the server is known by its cluster too."""
    import ray

    first = driver_disk.server_name()
    ray.shutdown()
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        assert driver_disk.server_name() != first
        url = driver_disk.run_url("test-new-cluster")
        storage.write_bytes(f"{url}/file", b"y")
        assert storage.filesystem(url)[0].cat_file(f"{url}/file") == b"y"
        storage.remove(url)
    finally:
        ray.shutdown()  # the session's Ray starts again at the next test's ray_local


@pytest.mark.parametrize("on_the_drivers_machine", [True, False], ids=["rename", "chunks"])
def test_large_staged_files_come_home_through_the_folder_and_small_ones_with_the_results(
    folder, tmp_path, monkeypatch, on_the_drivers_machine
):
    """A rank's large file is copied into the driver's folder and only its URL comes back; the driver moves it to
    its path (a rename beside the server, in chunks for a Ray Client's driver) and the folder is left empty."""
    from ray_lightning.home import files, landing
    from ray_lightning.home.outbox import INLINE_BYTES, Outbox, SentFile

    if not on_the_drivers_machine:
        monkeypatch.setattr(driver_disk, "_local_path", lambda url: None)
    staging = tmp_path / "staging"
    driver_dir = tmp_path / "driver"
    big, small = os.urandom(INLINE_BYTES + 7), b"epoch,loss\n0,1.0\n"
    staged = Path(files.to_staged(str(driver_dir), str(staging)))
    (staged / "checkpoints").mkdir(parents=True)
    (staged / "checkpoints" / "epoch=0.ckpt").write_bytes(big)
    (staged / "metrics.csv").write_bytes(small)

    sent = files.collect(str(staging), Outbox(folder))

    checkpoint, log = str(driver_dir / "checkpoints" / "epoch=0.ckpt"), str(driver_dir / "metrics.csv")
    assert sent[log] == small, "a small file travels with the results"
    assert isinstance(sent[checkpoint], SentFile) and sent[checkpoint].size == len(big)
    written = landing.write(sent, landing.WriteScope((str(driver_dir),)))
    assert written == [checkpoint, log]
    assert (driver_dir / "checkpoints" / "epoch=0.ckpt").read_bytes() == big
    assert storage.filesystem(folder)[0].ls(storage.filesystem(folder)[1]) == [], "moved, not copied"


def test_a_file_refused_on_the_driver_is_removed_from_the_folder(folder, tmp_path, caplog):
    from ray_lightning.home import landing
    from ray_lightning.home.outbox import INLINE_BYTES, Outbox

    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(INLINE_BYTES))
    sent = {"/etc/not-yours.bin": Outbox(folder).take(str(source))}
    assert landing.write(sent, landing.WriteScope((str(tmp_path / "driver"),))) == []
    assert "refused to write /etc/not-yours.bin" in caplog.text
    assert storage.filesystem(folder)[0].ls(storage.filesystem(folder)[1]) == []


def test_the_mirror_sends_the_version_its_checkpoint_saw_of_a_large_file(folder, tmp_path):
    """With a recovery checkpoint, a staged rank 0 sends what changed; a large file is linked on the training thread,
    so the file Lightning replaces by the next epoch still goes home as it was."""
    from ray_lightning.home import files, landing
    from ray_lightning.home.outbox import INLINE_BYTES, SentFile

    staging = tmp_path / "staging"
    target = Path(files.to_staged(str(tmp_path / "driver" / "last.ckpt"), str(staging)))
    target.parent.mkdir(parents=True)
    first = os.urandom(INLINE_BYTES + 1)
    target.write_bytes(first)
    mirror = files.StagingMirror(str(staging), folder)
    changed, removed = mirror.changes()
    replacement = target.with_suffix(".tmp")
    replacement.write_bytes(b"the next epoch's")
    os.replace(replacement, target)  # a new file at the path, as a rename into place makes it
    sent = mirror.send(changed)
    assert removed == [] and isinstance(sent[str(tmp_path / "driver" / "last.ckpt")], SentFile)
    landing.write(sent, landing.WriteScope((str(tmp_path / "driver"),)))
    assert (tmp_path / "driver" / "last.ckpt").read_bytes() == first
    assert not any(Path(f"{staging}-snapshots").iterdir()), "the snapshot goes once it is sent"


def test_a_ranks_results_hold_at_most_the_inline_budget_of_small_files(folder, tmp_path):
    from ray_lightning.home import files, landing
    from ray_lightning.home.outbox import INLINE_BYTES, INLINE_TOTAL_BYTES, Outbox

    staging, driver_dir = tmp_path / "staging", tmp_path / "driver"
    staged = Path(files.to_staged(str(driver_dir), str(staging)))
    staged.mkdir(parents=True)
    for n in range(20):  # 20 files just under INLINE_BYTES: together over INLINE_TOTAL_BYTES
        (staged / f"{n}.log").write_bytes(os.urandom(INLINE_BYTES - 1))
    sent = files.collect(str(staging), Outbox(folder))
    inline = [data for data in sent.values() if isinstance(data, bytes)]
    assert len(sent) == 20 and sum(map(len, inline)) <= INLINE_TOTAL_BYTES
    assert len(inline) == INLINE_TOTAL_BYTES // (INLINE_BYTES - 1), "the rest went through the folder"
    written = landing.write(sent, landing.WriteScope((str(driver_dir),)))
    assert len(written) == 20 and all(os.path.getsize(p) == INLINE_BYTES - 1 for p in written)
