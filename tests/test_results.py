"""Putting the workers' results on the driver: prediction order, weights, checkpoint files (no Ray needed)."""

from __future__ import annotations

from collections import namedtuple

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from ray_lightning.home.landing import WriteScope
from ray_lightning.home.predictions import merge_predictions
from ray_lightning.home.results import WorkerOutput, apply_to_driver
from ray_lightning.home.weights import WeightPart, load_chunks, pack, pack_in_chunks, unpack

Pair = namedtuple("Pair", "a b")


def _strided(n: int, world: int, batch: int):
    """What UnrepeatedDistributedSampler gives each rank: indices r, r+world, ... in batches."""
    per_rank = []
    for r in range(world):
        idx = list(range(r, n, world))
        per_rank.append(
            [(0, idx[i : i + batch], torch.tensor(idx[i : i + batch]) * 10) for i in range(0, len(idx), batch)]
        )
    return per_rank


def test_tensor_predictions_come_back_in_dataset_order_and_batch_size():
    merged = merge_predictions(_strided(11, 3, 2), num_dataloaders=1)
    assert [b.tolist() for b in merged] == [[0, 10], [20, 30], [40, 50], [60, 70], [80, 90], [100]]


def test_nested_predictions_are_split_per_sample():
    rank0 = [(0, [0, 2], {"p": Pair(torch.tensor([0, 2]), torch.tensor([[0.0], [2.0]]))})]
    rank1 = [(0, [1, 3], {"p": Pair(torch.tensor([1, 3]), torch.tensor([[1.0], [3.0]]))})]
    (batch0, batch1) = merge_predictions([rank0, rank1], num_dataloaders=1)
    assert isinstance(batch0["p"], Pair)
    assert batch0["p"].a.tolist() == [0, 1] and batch1["p"].b.flatten().tolist() == [2.0, 3.0]


def test_unsplittable_predictions_are_ordered_by_batch_with_a_warning():
    rank0 = [(0, [2, 3], "second batch")]
    rank1 = [(0, [0, 1], "first batch")]
    with pytest.warns(UserWarning, match="per batch"):
        merged = merge_predictions([rank0, rank1], num_dataloaders=1)
    assert merged == ["first batch", "second batch"]


def test_several_dataloaders_stay_apart():
    rank0 = [(0, [0, 2], torch.tensor([0, 2])), (1, [0], torch.tensor([100]))]
    rank1 = [(0, [1, 3], torch.tensor([1, 3])), (1, [1], torch.tensor([101]))]
    first, second = merge_predictions([rank0, rank1], num_dataloaders=2)
    assert [b.tolist() for b in first] == [[0, 1], [2, 3]]
    assert [b.tolist() for b in second] == [[100], [101]]


def test_checkpoint_files_from_another_node_are_written_on_the_driver(tmp_path):
    # The driver has never seen this directory: rank 0 wrote it on its own node.
    remote_dir = tmp_path / "rank0-node" / "checkpoints"
    best = str(remote_dir / "epoch=1.ckpt")
    checkpoint = ModelCheckpoint(monitor="val_loss")
    trainer = pl.Trainer(callbacks=[checkpoint], logger=False)
    state = {
        "monitor": "val_loss",
        "best_model_score": torch.tensor(0.25),
        "best_model_path": best,
        "current_score": torch.tensor(0.5),
        "dirpath": str(remote_dir),
        "best_k_models": {best: torch.tensor(0.25)},
        "kth_best_model_path": best,
        "kth_value": torch.tensor(0.25),
        "last_model_path": "",
    }
    output = WorkerOutput(global_rank=0, callback_states=[(checkpoint.state_key, state)], files={best: b"weights"})

    apply_to_driver(trainer, output, WriteScope.of(trainer))

    assert (remote_dir / "epoch=1.ckpt").read_bytes() == b"weights"
    assert checkpoint.best_model_path == best
    assert checkpoint.best_model_score == 0.25
    assert checkpoint.best_k_models == {best: torch.tensor(0.25)}
    assert checkpoint.dirpath == str(remote_dir)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 4),
        torch.randn(3, 4, dtype=torch.float64).t(),  # not contiguous
        torch.tensor(7, dtype=torch.int64),  # 0-dim
        torch.zeros(0, 5),
        torch.tensor([True, False, True]),
        torch.randn(5).to(torch.bfloat16),  # a dtype numpy lacks
    ],
    ids=["float32", "float64-transposed", "scalar", "empty", "bool", "bfloat16"],
)
def test_weights_survive_packing(tensor):
    unpacked = unpack(pack(tensor))
    assert unpacked.dtype == tensor.dtype and unpacked.shape == tensor.shape
    assert torch.equal(unpacked, tensor)
    assert unpack(pack({"step": 3})) == {"step": 3}


def test_packed_weights_load_into_the_drivers_module():
    trained, driver = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    module = pl.LightningModule()
    module.net = driver
    trainer = pl.Trainer(logger=False)
    trainer.strategy.connect(module)
    parts = [WeightPart(f"net.{k}", v) for k, v in trained.state_dict().items()]
    apply_to_driver(trainer, WorkerOutput(global_rank=0), WriteScope(), pack_in_chunks(parts))
    assert torch.equal(driver.weight, trained.weight) and torch.equal(driver.bias, trained.bias)


@pytest.mark.parametrize("on_meta", [False, True], ids=["in-place", "meta-device"])
def test_shards_from_several_ranks_are_put_in_place(on_meta):
    trained = torch.nn.Linear(6, 5)
    with torch.device("meta" if on_meta else "cpu"):
        driver = torch.nn.Linear(6, 5)
    weight = trained.weight.detach()
    # Two ranks' row blocks of the weight (torch.chunk's split: 3 and 2 rows), rank 0 also the bias; small
    # chunks, so that the parts of one tensor arrive in different chunks.
    rank_zero = [WeightPart("weight", weight[:3], (5, 6), ((0, 3), (0, 6))), WeightPart("bias", trained.bias)]
    rank_one = [WeightPart("weight", weight[3:], (5, 6), ((3, 5), (0, 6)))]
    chunks = pack_in_chunks(rank_zero, chunk_bytes=1) + pack_in_chunks(rank_one, chunk_bytes=1)
    assert len(chunks) == 3
    load_chunks(driver, chunks)
    assert not driver.weight.is_meta and isinstance(driver.weight, torch.nn.Parameter)
    assert torch.equal(driver.weight, trained.weight) and torch.equal(driver.bias, trained.bias)
