"""RayDataModule: Ray Data datasets streamed into real Ray workers, checked by counting row ids."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from ray_lightning import RayStrategy
from ray_lightning.data import RayDataModule
from tests.conftest import alive_worker_actors

pytestmark = pytest.mark.usefixtures("ray_local")


def features(batch: dict) -> dict:
    """The preprocessing: two features per row from its id (runs as Ray Data tasks)."""
    ids = batch["id"].astype(np.float32)
    batch["x"] = np.stack([ids / 100.0, (ids % 7) / 7.0], axis=1)
    batch["node"] = np.array([_node_id()] * len(ids))
    return batch


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def dataset(rows: int, blocks: int = 5, preprocess: bool = False):
    """Rows ``id`` 0..rows-1 with features ``x``: computed by map_batches tasks (``preprocess``; the row count is
    then unknown until read) or given (the count is in the metadata)."""
    import ray

    if preprocess:
        return ray.data.range(rows, override_num_blocks=blocks).map_batches(features)
    ids = np.arange(rows)
    x = np.stack([ids / 100.0, (ids % 7) / 7.0], axis=1).astype(np.float32)
    return ray.data.from_items([{"id": int(i), "x": x[i]} for i in ids], override_num_blocks=blocks)


def id_model_class(base: type) -> type:
    """The test model on ``base`` (``pytorch_lightning`` or ``lightning.pytorch``'s LightningModule)."""

    class IdModel(base):
        """Writes every training batch's ids (and mask) with its epoch and global step to ``<out>/train-rank<r>.jsonl``;
        rank ``kill_rank`` SIGKILLs itself at ``kill_at`` (epoch, batch_idx) unless ``<out>/killed`` exists."""

        def __init__(self, out: str, kill_at: tuple[int, int] | None = None, kill_rank: int = 1) -> None:
            base.__init__(self)
            self.out, self.kill_at, self.kill_rank = out, kill_at, kill_rank
            self.layer = nn.Linear(2, 1)

        def _record(self, stage: str, batch: dict, **extra) -> None:
            row = {"epoch": self.current_epoch, "step": self.global_step, "ids": batch["id"].tolist(), **extra}
            if "mask" in batch:
                row["mask"] = batch["mask"].tolist()
            with open(os.path.join(self.out, f"{stage}-rank{self.global_rank}.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")

        def training_step(self, batch, batch_idx):
            marker = os.path.join(self.out, "killed")
            if self.kill_at == (self.current_epoch, batch_idx) and self.global_rank == self.kill_rank:
                if not os.path.exists(marker):
                    Path(marker).write_text("")
                    os.kill(os.getpid(), signal.SIGKILL)
            nodes = sorted(set(batch["node"].tolist())) if "node" in batch else []
            self._record("train", batch, nodes=nodes, batches=self.trainer.num_training_batches)
            return self.layer(batch["x"]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            ids = batch["id"].float()
            self.log("val_id_sum", ids.sum(), reduce_fx="sum", sync_dist=True)
            self.log("val_id_mean", ids.mean(), sync_dist=True, batch_size=len(ids))

        def test_step(self, batch, batch_idx):
            self.log("test_rows", float(len(batch["id"])), reduce_fx="sum", sync_dist=True)

        def predict_step(self, batch, batch_idx):
            return batch["id"] * 10

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return IdModel


IdModel = id_model_class(pl.LightningModule)


def _records(out, stage: str = "train") -> dict[int, list[dict]]:
    found = {}
    for path in sorted(Path(out).glob(f"{stage}-rank*.jsonl")):
        rank = int(path.stem.split("rank")[1])
        found[rank] = [json.loads(line) for line in path.read_text().splitlines()]
    return found


def _trainer(strategy=None, **kwargs) -> pl.Trainer:
    defaults = dict(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False, num_sanity_val_steps=0)  # fmt: skip
    defaults.update(kwargs)
    return pl.Trainer(strategy=strategy or RayStrategy(num_workers=2), **defaults)


def _ids_by_epoch(records: dict[int, list[dict]]) -> dict[int, list[int]]:
    by_epoch: dict[int, list[int]] = {}
    for rows in records.values():
        for row in rows:
            mask = row.get("mask") or [True] * len(row["ids"])
            by_epoch.setdefault(row["epoch"], []).extend(i for i, real in zip(row["ids"], mask) if real)
    return by_epoch


def test_every_rank_gets_the_same_batches_every_row_once_and_a_new_order_each_epoch(tmp_path):
    # 103 rows, 2 ranks x 8: 6 whole steps (96 rows) per epoch; the 7 left over are dropped from that epoch.
    # (The same order in a rerun with the same seed: the killed-worker test below compares two runs.)
    _trainer().fit(IdModel(str(tmp_path)), datamodule=RayDataModule(train=dataset(103), batch_size=8, seed=3))
    records = _records(tmp_path)
    assert sorted(records) == [0, 1]
    for rank, rows in records.items():
        assert Counter(row["epoch"] for row in rows) == {0: 6, 1: 6}, rank
        assert all(len(row["ids"]) == 8 and row["batches"] == 6 for row in rows), "the loaders' length is known"
    by_epoch = _ids_by_epoch(records)
    for epoch, ids in by_epoch.items():
        assert len(ids) == len(set(ids)) == 96, epoch
        assert set(ids) <= set(range(103))
    order = {
        e: [i for r in sorted(records) for row in records[r] if row["epoch"] == e for i in row["ids"]] for e in (0, 1)
    }
    assert order[0] != order[1], "each epoch has its own order"
    assert sorted(order[0]) != list(range(96)), "the rows are shuffled"


def test_pad_gives_every_row_once_and_masks_the_padding(tmp_path):
    dm = RayDataModule(train=dataset(103, preprocess=True), batch_size=8, last_batch="pad", shuffle="full", seed=1)
    trainer = _trainer(max_epochs=1)
    with pytest.warns(UserWarning, match="the train dataset's row count is unknown until it is read"):
        trainer.fit(IdModel(str(tmp_path)), datamodule=dm)
    records = _records(tmp_path)
    assert [len(rows) for rows in records.values()] == [7, 7]
    ids = _ids_by_epoch(records)[0]
    assert sorted(ids) == list(range(103)), "every row once among the real rows"
    padding = sum(not real for rows in records.values() for row in rows for real in row["mask"])
    assert padding == 7 * 16 - 103


def test_validation_test_and_predict_see_every_row_once_in_dataset_order(tmp_path):
    dm = RayDataModule(train=dataset(64), val=dataset(31, blocks=3), test=dataset(31, blocks=3),
                       predict=dataset(31, blocks=3), batch_size=8, eval_batch_size=4)  # fmt: skip
    trainer = _trainer(max_epochs=1, num_sanity_val_steps=2)
    trainer.fit(IdModel(str(tmp_path)), datamodule=dm)
    # 31 rows over 2 ranks in batches of 4: 8 batches, 4 each, the last one short; the same as one process.
    assert trainer.callback_metrics["val_id_sum"].item() == sum(range(31))
    assert trainer.callback_metrics["val_id_mean"].item() == pytest.approx(15.0)
    (tested,) = trainer.test(IdModel(str(tmp_path)), datamodule=dm, verbose=False)
    assert tested["test_rows"] == 31
    predictions = trainer.predict(IdModel(str(tmp_path)), datamodule=dm)
    assert torch.cat(predictions).tolist() == [10 * i for i in range(31)]


def test_a_killed_worker_resumes_the_epoch_at_the_next_untrained_row(tmp_path):
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    for out, kill_at in ((reference, None), (killed, (0, 4))):
        out.mkdir()
        strategy = RayStrategy(num_workers=2, max_failures=1, recovery_checkpoint_every_n_steps=2)
        trainer = _trainer(strategy, max_epochs=2)
        trainer.fit(IdModel(str(out), kill_at=kill_at), datamodule=RayDataModule(train=dataset(100), batch_size=5))
    (restart,) = trainer.strategy.restarts
    assert (restart.epoch, restart.global_step) == (0, 4), "killed at step 5, after the step-4 checkpoint"
    # What the weights saw: per rank and step, the batch of the last attempt that trained that step.
    effective = {r: {row["step"]: row["ids"] for row in rows} for r, rows in _records(killed).items()}
    expected = {r: {row["step"]: row["ids"] for row in rows} for r, rows in _records(reference).items()}
    # Also: a rerun with the same seed deals the same rows at the same steps.
    assert effective == expected, "the same rows at the same steps as without the failure"
    retrained = [row["step"] for row in _records(killed)[0] if row["epoch"] == 0]
    assert Counter(retrained)[4] == 2 and Counter(retrained)[3] == 1, "only the untrained step ran again"


def test_a_checkpoint_resumes_mid_epoch_on_another_number_of_workers(tmp_path):
    from pytorch_lightning.callbacks import ModelCheckpoint

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    dm = RayDataModule(train=dataset(96), batch_size=4, seed=5)
    _trainer(max_epochs=1, max_steps=3, enable_checkpointing=True, callbacks=[every]).fit(
        IdModel(str(first)), datamodule=dm
    )
    checkpoint = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    assert checkpoint.exists(), sorted(os.listdir(tmp_path / "ckpt"))
    # 3 steps of 2 ranks x 4 rows trained; one worker continues the epoch with the other 72 rows.
    trainer = _trainer(RayStrategy(num_workers=1), max_epochs=1)
    trainer.fit(IdModel(str(second)), datamodule=RayDataModule(train=dataset(96), batch_size=4, seed=5),
                ckpt_path=str(checkpoint))  # fmt: skip
    before, after = _ids_by_epoch(_records(first))[0], _ids_by_epoch(_records(second))[0]
    assert len(before) == 24 and len(after) == 72
    assert sorted(before + after) == list(range(96)), "no row repeated or skipped across the resize"


def test_preprocessing_runs_on_a_node_without_training_workers(tmp_path):
    from tests.conftest import connected_cluster, session_pythonpath

    # The workers need "trainer" resources, which only one node has; its 2 CPUs are all theirs. Ray Data's
    # tasks (and the dealer, which unpickles the dataset) import `features` from this module: the job ships the
    # checkout, as a user's job ships its code (runtime_env), since Ray pickles module functions by reference.
    nodes = ({"num_cpus": 2, "resources": {"trainer": 2}}, {"num_cpus": 2})
    with connected_cluster(*nodes, runtime_env={"env_vars": {"PYTHONPATH": session_pythonpath()}}):
        strategy = RayStrategy(num_workers=2, resources_per_worker={"trainer": 1})
        trainer = _trainer(strategy, max_epochs=1)
        trainer.fit(IdModel(str(tmp_path)), datamodule=RayDataModule(train=dataset(64, preprocess=True), batch_size=8))
        import ray

        trainer_node = next(n["NodeID"] for n in ray.nodes() if n["Resources"].get("trainer"))
    records = _records(tmp_path)
    nodes = {node for rows in records.values() for row in rows for node in row["nodes"]}
    assert nodes and trainer_node not in nodes, "map_batches ran off the training node"
    assert sorted(_ids_by_epoch(records)[0]) == list(range(64))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: RayDataModule(train=dataset(10), batch_size=8), "larger than a rank's share"),
        (lambda: RayDataModule(train=_empty(), batch_size=2), "has no rows"),
        (lambda: RayDataModule(train=dataset(10), batch_size=2, columns=["x", "label"]), r"no column\(s\) \['label'\]"),
        (lambda: RayDataModule(val=dataset(10)), "needs a train dataset"),
    ],
)
def test_bad_data_fails_before_any_worker_starts(make, match, no_waiting_workers):
    with pytest.raises(ValueError, match=match):
        _trainer().fit(IdModel("."), datamodule=make())
    assert not alive_worker_actors()


def _empty():
    import ray

    return ray.data.from_numpy(np.zeros((0, 2), dtype=np.float32))


def test_bad_arguments_and_a_non_ray_strategy_are_refused():
    with pytest.raises(ValueError, match="shuffle='sometimes'"):
        RayDataModule(train=dataset(10), shuffle="sometimes")
    with pytest.raises(ValueError, match="batch_size=0"):
        RayDataModule(train=dataset(10), batch_size=0)
    with pytest.raises(TypeError, match="takes a ray.data.Dataset, not list"):
        RayDataModule(train=[1, 2])
    plain = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False)
    with pytest.raises(TypeError, match="this Trainer's strategy is SingleDeviceStrategy"):
        plain.fit(IdModel("."), datamodule=RayDataModule(train=dataset(10), batch_size=2))


def _lightning_fsdp2():
    import lightning.pytorch as L

    from ray_lightning import RayFSDPStrategy

    return L.Trainer, id_model_class(L.LightningModule), RayFSDPStrategy(num_workers=2)


def _deepspeed():
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (python3 dev.py test installs it)")
    from ray_lightning import RayDeepSpeedStrategy

    return pl.Trainer, IdModel, RayDeepSpeedStrategy(num_workers=2, stage=2)


def _horovod():
    pytest.importorskip("horovod.torch", reason="Horovod is not installed: `python3 dev.py test` builds it")
    from ray_lightning import HorovodRayStrategy

    return pl.Trainer, IdModel, HorovodRayStrategy(num_workers=2)


@pytest.mark.parametrize(
    "make", [_lightning_fsdp2, _deepspeed, _horovod], ids=["fsdp2-lightning", "deepspeed", "horovod"]
)
def test_every_strategy_gets_every_row_once(make, tmp_path):
    trainer_class, model_class, strategy = make()
    trainer = trainer_class(strategy=strategy, max_epochs=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(model_class(str(tmp_path)), datamodule=RayDataModule(train=dataset(32), batch_size=4))
    records = _records(tmp_path)
    assert [len(rows) for rows in records.values()] == [4, 4]
    assert sorted(_ids_by_epoch(records)[0]) == list(range(32))


def train_in_a_trial(config):
    from ray import tune

    out = config["out"]
    trainer = _trainer(max_epochs=1)
    trainer.fit(IdModel(out), datamodule=RayDataModule(train=dataset(40), batch_size=4, seed=config["seed"]))
    tune.report({"rows": sum(len(r["ids"]) for rows in _records(out).values() for r in rows)})


def test_a_tune_trial_streams_its_dataset_into_its_workers(tmp_path):
    from ray import tune

    from ray_lightning.tune import get_tune_resources

    tuner = tune.Tuner(
        tune.with_resources(train_in_a_trial, get_tune_resources(2)),
        param_space={"out": str(tmp_path), "seed": 1},
        run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), verbose=0),
    )
    (result,) = tuner.fit()
    assert not result.error and result.metrics["rows"] == 40
    assert sorted(_ids_by_epoch(_records(tmp_path))[0]) == list(range(40))


def test_the_ray_data_example_trains_and_reports_its_metrics(capsys):
    from examples.ray_data_digits import main

    trainer = main(["--max-epochs", "1"])
    assert trainer.current_epoch == 1 and trainer.global_step == 1400 // 128
    assert trainer.callback_metrics["val_acc"] > 0.3  # chance: 0.1
    assert "val_acc = " in capsys.readouterr().out
