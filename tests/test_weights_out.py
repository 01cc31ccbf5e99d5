"""The module's big tensors travel to the workers beside the payload (launch.weights_out), with real Ray."""

from __future__ import annotations

import threading

import pytest
import pytorch_lightning as pl
import ray
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ray_lightning import RayStrategy
from ray_lightning.launch.payload import put_payload
from ray_lightning.launch.weights_out import ASIDE_BYTES, take_weights


class TiedModel(pl.LightningModule):
    """A language-model-like head tied to its embedding: 2 MB of float32, one Parameter in two modules."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__()
        self.lr = lr
        self.embed = torch.nn.Embedding(1024, 512)
        self.head = torch.nn.Linear(512, 1024, bias=False)
        self.head.weight = self.embed.weight
        torch.nn.init.normal_(self.embed.weight, std=0.02)  # small: the loss is not zero at the start
        self.register_buffer("table", torch.arange(2**19, dtype=torch.float32))  # 2 MB, a buffer
        self.small = torch.nn.Linear(4, 4)
        # What the workers must find when training starts (the driver's weights, not the placeholders).
        self.sent_corner = self.embed.weight.detach()[:4, :8].clone()  # small: pickled in the payload

    def on_train_start(self) -> None:
        assert self.head.weight is self.embed.weight, "the tied weights arrived as two tensors"
        assert torch.equal(self.embed.weight.detach()[:4, :8], self.sent_corner), "not the driver's weights"
        assert torch.equal(self.table, torch.arange(2**19, dtype=torch.float32))

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return (
            F.cross_entropy(self.head(self.embed(tokens)), tokens)
            + 0 * self.small(tokens.new_zeros(1, 4).float()).sum()
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(64) % 1024), batch_size=8)


def test_tied_big_weights_reach_the_workers_and_the_trained_ones_come_home(ray_local):
    model = TiedModel()
    assert model.embed.weight.numel() * 4 >= ASIDE_BYTES  # travels beside the payload
    before = model.embed.weight.detach().clone()
    trainer = pl.Trainer(strategy=RayStrategy(num_workers=2), max_epochs=1, logger=False, enable_checkpointing=False)
    trainer.fit(model)
    assert model.head.weight is model.embed.weight
    assert not torch.equal(model.embed.weight, before)  # trained in the workers, home on the driver
    assert torch.equal(model.table, torch.arange(2**19, dtype=torch.float32))


@ray.remote(num_cpus=0)
def _unpickle_in_a_worker(payload: list) -> dict:
    trainer, function, args, kwargs, aside, _strategy = ray.get(payload[0])
    module = args[0]
    take_weights(aside)
    return {
        "tied": module.head.weight is module.embed.weight,
        "weight": module.embed.weight.detach().clone(),
        "requires_grad": module.embed.weight.requires_grad,
        "table": module.table.clone(),
        "small": module.small.weight.detach().clone(),
    }


def test_the_payload_carries_placeholders_and_the_driver_keeps_its_tensors(ray_local):
    model = TiedModel()
    pointer = model.embed.weight.data_ptr()
    payload = put_payload(None, lambda m: m, (model,), {})
    # The driver's module has its own tensors back, untouched.
    assert model.embed.weight.data_ptr() == pointer and model.head.weight is model.embed.weight
    assert torch.equal(model.embed.weight.detach()[:4, :8], model.sent_corner)
    got = ray.get(_unpickle_in_a_worker.remote([payload]))
    assert got["tied"] and got["requires_grad"]
    assert torch.equal(got["weight"], model.embed.weight.detach())
    assert torch.equal(got["table"], model.table) and torch.equal(got["small"], model.small.weight.detach())


def test_the_driver_gets_its_tensors_back_when_the_payload_cannot_be_pickled(ray_local):
    model = TiedModel()
    model.lock = threading.Lock()
    pointer = model.embed.weight.data_ptr()
    with pytest.raises(TypeError, match="lock"):
        put_payload(None, lambda m: m, (model,), {})
    assert model.embed.weight.data_ptr() == pointer and model.embed.weight.stride() == (512, 1)


def _shared_resident_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssShmem:"))


def test_read_object_store_pages_leave_the_drivers_memory_and_the_data_stays(ray_local):
    import numpy as np

    from ray_lightning.home.weights import release_pages

    sent = np.arange(2**21, dtype=np.float32)  # 8 MB
    got = ray.get(ray.put(sent))
    assert not got.flags.writeable  # in place in the object store
    float(got.sum())  # every page read: resident in this process
    before = _shared_resident_kb()
    release_pages([got])
    assert before - _shared_resident_kb() >= 7 * 1024
    assert np.array_equal(got, sent)  # read again from the store
    own = sent.copy()
    release_pages([own])  # this process's own memory: left alone
    assert np.array_equal(own, sent)
