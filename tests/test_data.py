"""RayDataModule: Ray Data datasets streamed into real Ray workers, checked by counting row ids."""

from __future__ import annotations

import json
import os
import signal
import time
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
from tests.data_functions import features, stamped

pytestmark = pytest.mark.usefixtures("ray_local")


def dataset(rows: int, blocks: int = 5, preprocess: bool = False):
    """Rows ``id`` 0..rows-1 with features ``x``: computed by map_batches tasks (``preprocess``; the row count is
    then unknown until read) or given (the count is in the metadata)."""
    import ray

    if preprocess:
        return ray.data.range(rows, override_num_blocks=blocks).map_batches(features)
    ids = np.arange(rows)
    x = np.stack([ids / 100.0, (ids % 7) / 7.0], axis=1).astype(np.float32)
    return ray.data.from_items([{"id": int(i), "x": x[i]} for i in ids], override_num_blocks=blocks)


def _wait_for_a_recovery_checkpoint(since_step: int) -> None:
    """In a worker, before it is killed: until a recovery checkpoint of ``since_step`` or later is complete (they are
    written beside training; the tests check where the restart resumes, not a race with the upload)."""
    from ray_lightning import runtime
    from ray_lightning.home import storage
    from tests.conftest import wait_for

    run = runtime.current_context().recovery.storage_run

    def complete() -> bool:
        entry = storage.newest_complete(run)
        return entry is not None and entry.header["global_step"] >= since_step

    wait_for(complete, 60, f"the recovery checkpoint of step {since_step} or later")


def id_model_class(base: type) -> type:
    """The test model on ``base`` (``pytorch_lightning`` or ``lightning.pytorch``'s LightningModule)."""

    class IdModel(base):
        """Writes every training batch's ids (and mask) with its epoch and global step to ``<out>/train-rank<r>.jsonl``;
        rank ``kill_rank`` SIGKILLs itself at ``kill_at`` (epoch, batch_idx) unless ``<out>/killed`` exists, once the
        recovery checkpoint before that step is complete."""

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
                    _wait_for_a_recovery_checkpoint(since_step=self.global_step - 1)
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
    assert (restart.epoch, restart.global_step) == (0, 4), "killed in step 5: the survivor's state after step 4"
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
    # tasks (and the coordinator, which unpickles the dataset) import `features` from tests/: the job ships the
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


# -- The coordinator hands out metadata; the ranks read their own blocks ---------------------------------------


def _stamped_dataset(rows: int, blocks: int, out, pause_s: float = 0.0):
    import functools

    import ray

    fn = functools.partial(stamped, out=str(out), pause_s=pause_s)
    return ray.data.range(rows, override_num_blocks=blocks).map_batches(fn, batch_size=None)


def _blocks(out) -> list[dict]:
    path = Path(out) / "blocks.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class FirstBatchClock(pl.Callback):
    """Writes when each rank's first training batch began to ``<out>/first-rank<r>.txt``."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        path = os.path.join(self.out, f"first-rank{trainer.global_rank}.txt")
        if not os.path.exists(path):
            Path(path).write_text(str(time.time()))


def test_the_default_shuffle_trains_before_the_pipeline_has_made_its_last_block(tmp_path):
    # 40 blocks of 0.3 s of work each on the 6 CPUs the 2 workers leave to Ray Data: about 2 s of pipeline. The
    # first step needs only the first window (32 rows: one block); an all-to-all shuffle would need all 40.
    dm = RayDataModule(train=_stamped_dataset(640, 40, tmp_path, 0.3), batch_size=8, shuffle_buffer=16, seed=2)
    _trainer(max_epochs=1, callbacks=[FirstBatchClock(str(tmp_path))]).fit(IdModel(str(tmp_path)), datamodule=dm)
    blocks = _blocks(tmp_path)
    first = min(float((tmp_path / f"first-rank{r}.txt").read_text()) for r in range(2))
    done_before = [b for b in blocks if b["at"] < first]
    assert len(blocks) == 40 and len(done_before) < 40, f"{len(done_before)} of 40 blocks made before the first step"
    ids = _ids_by_epoch(_records(tmp_path))[0]
    assert sorted(ids) == list(range(640)) and ids != sorted(ids), "every row once, shuffled"


def test_a_restart_reads_its_resumed_epoch_without_running_the_pipeline_again(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    strategy = RayStrategy(num_workers=2, max_failures=1, recovery_checkpoint_every_n_steps=2)
    dm = RayDataModule(train=_stamped_dataset(160, 10, out), batch_size=4, shuffle_buffer=32, seed=4)
    trainer = _trainer(strategy, max_epochs=1)
    trainer.fit(IdModel(str(out), kill_at=(0, 13)), datamodule=dm)
    (restart,) = trainer.strategy.restarts
    assert (restart.global_step, restart.source) == (13, "memory"), "killed in step 14: the survivor's state after 13"
    effective = {}
    for rank, rows in _records(out).items():
        for row in rows:
            effective[(rank, row["step"])] = row["ids"]  # the last attempt's batch of each step
    assert sorted(i for ids in effective.values() for i in ids) == list(range(160)), "every row once"
    made = Counter(b["first"] for b in _blocks(out))
    assert len(made) == 10 and set(made.values()) == {1}, f"each block made once, not again for the restart: {made}"


def test_blocks_of_any_size_empty_ones_and_a_widening_type_train_every_row_once(tmp_path):
    import pyarrow as pa
    import ray
    from ray.data.extensions import ArrowTensorArray

    sizes = [1, 0, 300, 2, 0, 45]  # one row, empty blocks, a block larger than an epoch's step (2 x 16)
    tables, start = [], 0
    for i, n in enumerate(sizes):
        ids = np.arange(start, start + n)
        v = pa.array(ids if i % 2 else ids.astype(np.float64) / 2)  # int64 in odd blocks, float64 in even ones
        x = np.stack([ids / 100.0, (ids % 7) / 7.0], axis=1).astype(np.float32)
        tables.append(pa.table({"id": pa.array(ids), "v": v, "x": ArrowTensorArray.from_numpy(x)}))
        start += n
    dm = RayDataModule(train=ray.data.from_arrow(tables), batch_size=16, last_batch="pad", shuffle_buffer=64)
    _trainer(max_epochs=1).fit(IdModel(str(tmp_path)), datamodule=dm)
    assert sorted(_ids_by_epoch(_records(tmp_path))[0]) == list(range(348))


def test_a_column_whose_type_changes_between_blocks_is_refused_before_any_worker_starts(no_waiting_workers):
    import pyarrow as pa
    import ray

    tables = [pa.table({"id": [0, 1], "x": [1, 2]}), pa.table({"id": [2, 3], "x": ["a", "b"]})]
    with pytest.raises(ValueError, match="the train dataset's blocks do not share one schema.*x.*int64.*string"):
        _trainer().fit(IdModel("."), datamodule=RayDataModule(train=ray.data.from_arrow(tables), batch_size=1))
    assert not alive_worker_actors()


def test_a_dataset_too_small_after_its_preprocessing_fails_its_first_pass_naming_the_rows(tmp_path):
    from ray_lightning.errors import RayWorkerError

    dm = RayDataModule(train=dataset(100, preprocess=True), batch_size=64)
    with pytest.raises(RayWorkerError, match="the train dataset had 100 rows; one training step on 2 workers x "
                                             "batch_size 64 needs 128"):  # fmt: skip
        _trainer(max_epochs=1).fit(IdModel(str(tmp_path)), datamodule=dm)


class StoreProbe(pl.Callback):
    """Rank 0 writes the object store's objects and bytes at each epoch's end to ``<out>/store.jsonl``."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            with open(os.path.join(self.out, "store.jsonl"), "a") as f:
                f.write(json.dumps(object_store_usage()) + "\n")


def object_store_usage() -> dict:
    """The objects and bytes in this node's object store (what ``ray memory`` reads)."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return {"objects": reply.store_stats.num_local_objects, "bytes": reply.store_stats.object_store_bytes_used}


def test_a_reused_module_leaves_nothing_in_the_object_store_after_twenty_epochs_and_two_fits(tmp_path):
    import ray

    wide = ray.data.range_tensor(128, shape=(1024,), override_num_blocks=8).map_batches(
        lambda b: {"id": np.arange(len(b["data"])), "x": b["data"][:, :2].astype(np.float32)}
    )  # 8 blocks an epoch, and what each execution puts (its read tasks, 1 MB): what an epoch left behind shows
    dm = RayDataModule(train=wide, batch_size=16, shuffle_buffer=32)
    before = object_store_usage()
    for epochs in (20, 3):
        _trainer(max_epochs=epochs, callbacks=[StoreProbe(str(tmp_path))]).fit(IdModel(str(tmp_path)), datamodule=dm)
    store = [json.loads(line) for line in (tmp_path / "store.jsonl").read_text().splitlines()]
    assert len(store) == 23
    grown = [s["bytes"] - store[1]["bytes"] for s in store[2:20]]
    assert max(grown) < 256 * 1024, f"the object store grew epoch after epoch: {grown}"
    # The coordinators are killed as each call ends; their objects go once Ray has seen them die.
    deadline = time.monotonic() + 30
    while (after := object_store_usage())["bytes"] > before["bytes"] + 64 * 1024 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert after["bytes"] <= before["bytes"] + 64 * 1024, f"left in the object store after the fits: {before}, {after}"


def test_block_metadata_without_row_counts_and_slices_are_read_as_rows():
    import pyarrow as pa
    import ray
    from ray.data._internal.execution.interfaces.ref_bundle import BlockEntry, BlockSlice, RefBundle
    from ray.data.block import BlockMetadata

    from ray_lightning._ray.data import block_parts

    refs = [ray.put(pa.table({"id": list(range(n))})) for n in (5, 7)]
    bundles = [
        RefBundle((BlockEntry(refs[0], BlockMetadata(None, 40, None)),), None, False),  # no row count
        RefBundle((BlockEntry(refs[1], BlockMetadata(7, 56, None)),), None, False, (BlockSlice(2, 6),)),
    ]

    class Bundles:
        def iter_internal_ref_bundles(self):
            return iter(bundles)

    assert [(ref, first, rows, size) for ref, first, rows, size in block_parts(Bundles())] == [
        (refs[0], 0, 5, 40),
        (refs[1], 2, 4, 32),
    ]


def test_ray_datas_plan_leaves_out_the_workers_cpus_and_keeps_a_users_limit():
    from ray.data import ExecutionResources

    from ray_lightning._ray.data import prepare_context

    mine = dataset(10)
    prepare_context(mine, {"cpu": 4.0, "gpu": 0.0})
    options = mine.context.execution_options
    assert options.exclude_resources.cpu == 4 and options.preserve_order
    limited = dataset(10)
    limited.context.execution_options.resource_limits = ExecutionResources(cpu=3)
    prepare_context(limited, {"cpu": 4.0, "gpu": 1.0})
    assert limited.context.execution_options.exclude_resources.cpu == 0, "the user's own CPU limit stands"
    assert limited.context.execution_options.exclude_resources.gpu == 1
    assert mine.context.enable_progress_bars is False
