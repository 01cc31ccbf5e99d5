"""Several Ray nodes on this machine (ray.cluster_utils.Cluster): ranks, data preparation, checkpoints."""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest
import pytorch_lightning as pl
import ray
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from ray_lightning import HorovodRayStrategy, RayStrategy
from tests.conftest import connected_cluster
from tests.models import BoringModel, HorovodRanks, Recorder, StagingMode, read_records
from tests.test_training import PrepareDataModule


@pytest.fixture(scope="module")
def two_node_cluster():
    """A head node the driver runs on (no worker slots) and two nodes with two worker slots each."""
    nodes = ({"num_cpus": 2, "resources": {"worker_slot": 2, name: 1}} for name in ("node_a", "node_b"))
    with connected_cluster(*nodes) as cluster:
        yield cluster


def test_ranks_data_and_checkpoints_across_nodes(two_node_cluster, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", save_last=True)
    strategy = RayStrategy(num_workers=4, resources_per_worker={"CPU": 1, "worker_slot": 1})
    trainer = pl.Trainer(
        max_epochs=2,
        strategy=strategy,
        callbacks=[Recorder(tmp_path), checkpoint, StagingMode(tmp_path)],
        logger=False,
        enable_progress_bar=False,
    )
    model = BoringModel()
    before = model.layer.weight.clone()
    with pytest.warns(UserWarning, match="no storage_path is set, so the ModelCheckpoint files come") as said:
        trainer.fit(model, datamodule=PrepareDataModule(marks))
    # Once, with what a checkpoint costs and what avoids it.
    (warning,) = [w for w in said if "no storage_path is set" in str(w.message)]
    assert "MiB of weights per checkpoint" in str(warning.message) and "storage_path='s3://" in str(warning.message)

    starts = read_records(tmp_path, "fit", "start")
    assert [s["global_rank"] for s in starts] == [0, 1, 2, 3]
    by_node = defaultdict(list)
    for s in starts:
        by_node[s["node_id"]].append(s)
    driver_node = ray.get_runtime_context().get_node_id()
    assert len(by_node) == 2 and driver_node not in by_node
    assert sorted(records[0]["node_rank"] for records in by_node.values()) == [0, 1]
    for records in by_node.values():
        assert sorted(r["local_rank"] for r in records) == [0, 1]
        assert len({r["node_rank"] for r in records}) == 1
        ranks = sorted(r["global_rank"] for r in records)
        assert ranks[1] == ranks[0] + 1, "workers on one node should hold consecutive global ranks"
    assert {(s["world_size"], s["num_nodes"]) for s in starts} == {(4, 2)}

    # prepare_data ran once per node, on local rank 0.
    assert len(list(marks.iterdir())) == 2

    # Rank 0 ran on another node: its checkpoints were copied to the driver and load here.
    assert not torch.equal(before, model.layer.weight)
    assert checkpoint.best_model_path in trainer.strategy.launcher.transferred_files
    assert checkpoint.last_model_path in trainer.strategy.launcher.transferred_files
    restored = BoringModel.load_from_checkpoint(checkpoint.best_model_path)
    assert restored.hparams.batch_size == 8
    assert os.path.getsize(checkpoint.best_model_path) > 0
    # Rank 0 staged its files in a directory only its user can enter.
    assert json.loads((tmp_path / "staging-mode.json").read_text()) == {"rank": 0, "mode": 0o700}


class RestoredFrom(pl.Callback):
    """Records, per rank, the checkpoint file Lightning restored from and whether it was readable there."""

    def __init__(self, directory) -> None:
        self.directory = str(directory)

    def on_train_start(self, trainer, pl_module):
        import json

        with open(f"{self.directory}/restored-rank{trainer.global_rank}.json", "w") as f:
            json.dump({"ckpt_path": trainer.ckpt_path, "epoch": trainer.current_epoch}, f)


def test_resume_sends_the_drivers_checkpoint_to_workers_on_other_nodes(two_node_cluster, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    resources = {"CPU": 1, "worker_slot": 1}

    def trainer(max_epochs, callbacks):
        strategy = RayStrategy(num_workers=4, resources_per_worker=resources)
        return pl.Trainer(
            max_epochs=max_epochs, strategy=strategy, callbacks=callbacks, logger=False, enable_progress_bar=False
        )

    first = trainer(1, [checkpoint])
    first.fit(BoringModel())
    last = checkpoint.last_model_path

    resumed = trainer(3, [RestoredFrom(tmp_path)])
    resumed.fit(BoringModel(), ckpt_path=last)

    assert resumed.current_epoch == 3 and resumed.global_step == 3 * 2
    records = [__import__("json").loads((tmp_path / f"restored-rank{r}.json").read_text()) for r in range(4)]
    # Every worker runs on another node than the driver: each read its own copy of the file.
    paths = [r["ckpt_path"] for r in records]
    assert last not in paths and len(set(paths)) == 4, paths
    assert all(os.path.basename(p) == os.path.basename(last) for p in paths)
    assert {r["epoch"] for r in records} == {1}
    assert not any(os.path.exists(p) for p in paths), "the copies should be removed after the fit"


def test_placement_spreads_when_one_node_is_not_enough(two_node_cluster, tmp_path):
    # 3 workers, 2 slots per node: PACK fills one node and puts the third worker on the other.
    strategy = RayStrategy(num_workers=3, resources_per_worker={"CPU": 1, "worker_slot": 1})
    trainer = pl.Trainer(
        max_epochs=1, strategy=strategy, callbacks=[Recorder(tmp_path)], logger=False, enable_progress_bar=False
    )
    trainer.fit(BoringModel())
    starts = read_records(tmp_path, "fit", "start")
    per_node = defaultdict(list)
    for s in starts:
        per_node[s["node_id"]].append((s["global_rank"], s["local_rank"], s["node_rank"]))
    assert sorted(len(v) for v in per_node.values()) == [1, 2]
    assert sorted(g for v in per_node.values() for g, _, _ in v) == [0, 1, 2]


def test_horovod_with_uneven_nodes(two_node_cluster, tmp_path):
    pytest.importorskip("horovod.torch", reason="Horovod is not installed: `python3 dev.py test` builds it")
    # 3 packed workers on nodes with 2 slots each: two on one node, one on the other.
    strategy = HorovodRayStrategy(num_workers=3, resources_per_worker={"CPU": 1, "worker_slot": 1})
    trainer = pl.Trainer(
        max_epochs=1, strategy=strategy, callbacks=[HorovodRanks(tmp_path)], logger=False, enable_progress_bar=False
    )
    trainer.fit(BoringModel())
    records = read_records(tmp_path, "fit", "horovod")
    assert [r["hvd_rank"] for r in records] == [0, 1, 2]
    assert sorted(r["hvd_local_size"] for r in records) == [1, 2, 2]
    assert "val_loss" in trainer.callback_metrics


def test_horovod_hosts_and_slots_put_each_hosts_workers_on_one_node(two_node_cluster, tmp_path):
    pytest.importorskip("horovod.torch", reason="Horovod is not installed: `python3 dev.py test` builds it")
    strategy = HorovodRayStrategy(num_hosts=2, num_slots=2, resources_per_worker={"CPU": 1, "worker_slot": 1})
    trainer = pl.Trainer(
        max_epochs=1, strategy=strategy, callbacks=[HorovodRanks(tmp_path)], logger=False, enable_progress_bar=False
    )
    model = BoringModel()
    before = model.layer.weight.clone()
    trainer.fit(model)

    assert not torch.equal(before, model.layer.weight)
    records = read_records(tmp_path, "fit", "horovod")
    assert [(r["global_rank"], r["hvd_rank"], r["hvd_size"]) for r in records] == [(i, i, 4) for i in range(4)]
    nodes = [r["node_id"] for r in records]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3], "a host's slots did not land on one node"
    assert ray.get_runtime_context().get_node_id() not in nodes
    # Horovod's own view of the layout: local ranks within a host, cross ranks across hosts.
    layout = [(r["hvd_local_rank"], r["hvd_local_size"], r["hvd_cross_rank"], r["hvd_cross_size"]) for r in records]
    assert layout == [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]


class WithBallast(BoringModel):
    """A checkpoint over home.outbox.INLINE_BYTES: it comes home through the driver's folder, not the results."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ballast", torch.arange(2**19, dtype=torch.float32))


def test_logs_and_checkpoints_of_rank_zero_on_another_node_land_on_the_driver(two_node_cluster, tmp_path):
    # Rank 0 runs on another node than the driver: it writes under a staging directory there, and
    # everything comes back to the paths the driver chose (here relative to its working directory): the logs with
    # the results, the checkpoints (2 MiB) copied by rank 0 into the driver's folder and moved into place.
    from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

    from ray_lightning.home import driver_disk
    from ray_lightning.home.outbox import INLINE_BYTES

    loggers = [CSVLogger("logs"), TensorBoardLogger("tb")]
    checkpoint = ModelCheckpoint(monitor="val_loss")
    strategy = RayStrategy(num_workers=2, resources_per_worker={"CPU": 1, "worker_slot": 1})
    trainer = pl.Trainer(max_epochs=2, strategy=strategy, callbacks=[checkpoint], logger=loggers, log_every_n_steps=1)
    model = WithBallast()
    trainer.fit(model)

    csv_dir = tmp_path / "logs" / "lightning_logs" / "version_0"
    assert trainer.logger.log_dir == str(csv_dir)
    rows = (csv_dir / "metrics.csv").read_text().splitlines()
    assert rows[0].split(",").count("val_loss") == 1 and len(rows) > 2
    assert list((tmp_path / "tb" / "lightning_logs" / "version_0").glob("events.out.tfevents.*"))
    assert checkpoint.best_model_path.startswith(str(csv_dir / "checkpoints"))
    transferred = trainer.strategy.launcher.transferred_files
    assert checkpoint.best_model_path in transferred and str(csv_dir / "metrics.csv") in transferred
    assert os.path.getsize(checkpoint.best_model_path) > INLINE_BYTES
    assert torch.equal(WithBallast.load_from_checkpoint(checkpoint.best_model_path).ballast, model.ballast)
    assert os.listdir(driver_disk.server_folder()) == [], "what came through the driver's folder left it"

    # "best" means the file on the driver's machine; workers elsewhere get a copy.
    assert trainer.test(model, ckpt_path="best", verbose=False)[0]["test_loss"] > 0


class FailsInEpoch(BoringModel):
    def __init__(self, epoch: int, dies: bool = False):
        super().__init__()
        self.fail_epoch, self.dies = epoch, dies

    def training_step(self, batch, batch_idx):
        if self.current_epoch == self.fail_epoch and self.dies and self.global_rank == 0:
            os._exit(1)
        if self.current_epoch == self.fail_epoch:
            raise RuntimeError("fails on purpose")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("dies", [False, True], ids=["rank 0 raises: it collects its files", "rank 0 dies: a task"])
def test_a_failed_fit_still_brings_rank_zeros_checkpoints_to_the_driver(two_node_cluster, tmp_path, dies):
    from ray_lightning import RayWorkerError

    checkpoint = ModelCheckpoint(dirpath="ckpt", save_top_k=-1)
    strategy = RayStrategy(num_workers=2, resources_per_worker={"CPU": 1, "worker_slot": 1})
    trainer = pl.Trainer(
        max_epochs=3, strategy=strategy, callbacks=[checkpoint], logger=False, enable_progress_bar=False
    )
    with pytest.raises(RayWorkerError, match="rank 0 .*died" if dies else "fails on purpose"):
        trainer.fit(FailsInEpoch(epoch=2, dies=dies))

    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert saved == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    # The checkpoint holds the driver's paths, not the staging directory's on rank 0's node.
    state = torch.load(tmp_path / "ckpt" / saved[-1], weights_only=False)
    callback_state = next(v for k, v in state["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert callback_state["dirpath"] == str(tmp_path / "ckpt")
    assert all(path.startswith(str(tmp_path / "ckpt")) for path in callback_state["best_k_models"])


def test_files_rank_zero_replaced_in_a_later_fit_are_removed_on_the_driver(two_node_cluster, tmp_path):
    checkpoint = ModelCheckpoint(dirpath="ckpt", monitor="val_loss", save_top_k=1)
    strategy = RayStrategy(num_workers=2, resources_per_worker={"CPU": 1, "worker_slot": 1})
    trainer = pl.Trainer(
        max_epochs=1, strategy=strategy, callbacks=[checkpoint], logger=False, enable_progress_bar=False
    )
    model = BoringModel()
    trainer.fit(model)
    first = checkpoint.best_model_path
    trainer.fit_loop.max_epochs = 3
    trainer.fit(model)
    assert checkpoint.best_model_path != first
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [os.path.basename(checkpoint.best_model_path)]
