"""Models bigger than one worker: RayFSDPStrategy (FSDP2) and RayModelParallelStrategy on real Ray workers with gloo.

FSDP2 and tensor parallelism run on CPU here; FSDP1 needs GPUs (its GPU runs are in tests/test_gpu.py, with every
sharded strategy's); DeepSpeed's CPU runs are in tests/test_deepspeed.py.
"""

from __future__ import annotations

import os

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from ray_lightning import RayFSDP1Strategy, RayFSDPStrategy, RayModelParallelStrategy, RayStrategy, release_idle_workers
from ray_lightning.namespaces import GLOO_SHARDING_TORCH, version_tuple
from tests.sharded_models import MLP, BlockModel, DenseBlockModel, ShardedMLP

pytestmark = [
    pytest.mark.usefixtures("ray_local"),
    pytest.mark.skipif(
        version_tuple(torch.__version__) < GLOO_SHARDING_TORCH,
        reason=f"FSDP2 on CPUs (gloo) needs torch 2.9, this is {torch.__version__}: RayFSDPStrategy and "
        "RayModelParallelStrategy refuse it (tests/test_namespaces.py checks that)",
    ),
]


def _fit(strategy, model_class, **trainer_kwargs):
    pl.seed_everything(0)
    model = model_class()
    defaults = dict(
        max_epochs=2,
        strategy=strategy,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    defaults.update(trainer_kwargs)
    trainer = pl.Trainer(**defaults)
    trainer.fit(model)
    return model, trainer


@pytest.fixture(scope="module")
def ddp_weights():
    """What DDP on 2 workers trains the MLP to: every sharded run of the same data must end there."""
    model, _ = _fit(RayStrategy(num_workers=2), MLP)
    return model.state_dict()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"auto_wrap_policy": {nn.Linear}, "sharding_strategy": "SHARD_GRAD_OP"},
        {"cpu_offload": True, "activation_checkpointing_policy": {nn.Linear}, "state_dict_type": "sharded"},
    ],
    ids=["defaults", "wrap-linear-shard-grad-op", "offload-recompute-sharded"],
)
def test_fsdp_trains_the_same_weights_as_ddp_and_brings_them_home(ddp_weights, options):
    model, trainer = _fit(RayFSDPStrategy(num_workers=2, **options), MLP)
    weights = model.state_dict()
    assert all(type(t) is torch.Tensor for t in weights.values()), "full tensors on the driver, not shards"
    torch.testing.assert_close(weights, ddp_weights)
    assert trainer.callback_metrics["val_loss"] > 0


def test_model_parallel_with_data_parallel_only_equals_ddp(ddp_weights):
    model, _ = _fit(RayModelParallelStrategy(num_workers=2), ShardedMLP)
    torch.testing.assert_close(model.state_dict(), ddp_weights)


class LateMLP(MLP):
    """The MLP with its layers made in configure_model (as for a model too big for one process): empty on the driver."""

    def __init__(self, **kwargs) -> None:
        super(MLP, self).__init__(**kwargs)
        del self.layer

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if not hasattr(self, "layer"):
            self.layer = nn.Sequential(nn.Linear(self.hparams.dim, 16), nn.ReLU(), nn.Linear(16, 1))
        fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])


def test_full_weights_home_none_decides_from_the_size_the_workers_built(monkeypatch, tmp_path):
    import psutil

    def size(module):
        return sum(t.numel() * t.element_size() for t in module.parameters())

    # The driver's free memory as a budget between the empty module's size and the built model's: only the
    # workers, after configure_model, can tell that the weights do not fit.
    empty, built = size(LateMLP()), size(MLP())
    assert empty < built
    available = type("Memory", (), {"available": empty + built})()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: available)
    _, trainer = _fit(RayModelParallelStrategy(num_workers=2), LateMLP, max_epochs=1)
    assert trainer.callback_metrics["val_loss"] > 0
    # The driver holds no trained weights: the workers, while they wait, write them; once gone, it is refused.
    trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
    assert os.path.exists(tmp_path / "weights.ckpt")
    release_idle_workers()
    with pytest.raises(RuntimeError, match="stayed in the workers' checkpoints"):
        trainer.save_checkpoint(tmp_path / "driver.ckpt", weights_only=True)


def test_tensor_parallel_block_trains_and_comes_home():
    reference, _ = _fit(RayStrategy(num_workers=1), DenseBlockModel)
    model, trainer = _fit(RayModelParallelStrategy(num_workers=2, tensor_parallel_size=2), BlockModel)
    before = DenseBlockModel().state_dict()
    weights = model.state_dict()
    assert weights.keys() == reference.state_dict().keys()
    assert not torch.equal(weights["block.q.weight"], before["block.q.weight"]), "the driver's module did not change"
    # Tensor parallelism splits each matmul between the ranks: the same training, up to rounding.
    torch.testing.assert_close(weights, reference.state_dict(), rtol=1e-4, atol=1e-5)
    assert trainer.callback_metrics["val_loss"] > 0


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: RayModelParallelStrategy(num_workers=4, tensor_parallel_size=3), ValueError, "does not divide"),
        (
            lambda: RayModelParallelStrategy(num_workers=4, data_parallel_size=2, tensor_parallel_size=3),
            ValueError,
            "must multiply to the number of workers",
        ),
        (lambda: RayModelParallelStrategy(num_workers=2, tensor_parallel_size=0), TypeError, "int >= 1"),
        (lambda: RayFSDPStrategy(num_workers=2, sharding_strategy="SHARD_EVERYTHING"), ValueError, "FULL_SHARD"),
        (lambda: RayFSDPStrategy(num_workers=2, auto_wrap_policy=["Linear"]), TypeError, "nn.Module classes"),
        (lambda: RayFSDPStrategy(num_workers=2, state_dict_type="zip"), ValueError, "'full' or 'sharded'"),
        (lambda: RayFSDPStrategy(num_workers=2, mixed_precision="bf16"), TypeError, "MixedPrecisionPolicy"),
        (lambda: RayFSDPStrategy(num_workers=2, reshard_after_forwards=True), TypeError, "reshard_after_forward"),
        (lambda: RayFSDPStrategy(num_workers=2, process_group_backend="nccl"), ValueError, "use_gpu=True"),
        (lambda: RayFSDP1Strategy(num_workers=2, use_gpu=False), ValueError, r"Use RayFSDPStrategy \(FSDP2\)"),
        (lambda: RayFSDP1Strategy(num_workers=2, auto_wrap_polcy={nn.Linear}), TypeError, "'auto_wrap_policy'"),
        (lambda: RayFSDP1Strategy(num_workers=2, device_id=0), TypeError, "sets device_id itself"),
    ],
)
def test_sizes_and_options_that_cannot_work_fail_in_the_constructor(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.usefixtures("no_waiting_workers")
def test_model_parallel_without_configure_model_fails_before_any_worker_starts():
    trainer = pl.Trainer(strategy=RayModelParallelStrategy(num_workers=2), logger=False, enable_checkpointing=False)
    with pytest.raises(TypeError, match="override configure_model.*RayFSDPStrategy"):
        trainer.fit(MLP())
    from tests.conftest import alive_worker_actors

    assert not alive_worker_actors()


def test_the_strategies_are_in_lightnings_registry():
    trainer = pl.Trainer(strategy="fsdp_ray", logger=False, enable_checkpointing=False)
    assert isinstance(trainer.strategy, RayFSDPStrategy)
    trainer = pl.Trainer(strategy="model_parallel_ray", logger=False, enable_checkpointing=False)
    assert isinstance(trainer.strategy, RayModelParallelStrategy)
    trainer = pl.Trainer(strategy="fsdp1_ray", logger=False, enable_checkpointing=False)
    assert isinstance(trainer.strategy, pl.strategies.FSDPStrategy) and trainer.strategy.use_gpu


@pytest.mark.usefixtures("no_waiting_workers")
def test_fsdp1_on_a_cluster_without_gpus_fails_before_any_worker_starts():
    from ray_lightning import ClusterResourceError

    strategy = RayFSDP1Strategy(num_workers=2, auto_wrap_policy={nn.Linear}, state_dict_type="sharded")
    trainer = pl.Trainer(strategy=strategy, logger=False, enable_checkpointing=False)
    with pytest.raises(ClusterResourceError, match="GPU"):
        trainer.fit(MLP())
    from tests.conftest import alive_worker_actors

    assert not alive_worker_actors()


def test_the_accelerator_forms_and_both_lightning_packages():
    import lightning.pytorch as L

    from ray_lightning import RayFSDPAccelerator, RayModelParallelAccelerator

    trainer = pl.Trainer(accelerator=RayFSDPAccelerator(num_workers=2, auto_wrap_policy={nn.Linear}), logger=False)
    assert isinstance(trainer.strategy, RayFSDPStrategy) and trainer.strategy.num_workers == 2
    trainer = L.Trainer(accelerator=RayModelParallelAccelerator(num_workers=2, tensor_parallel_size=2), logger=False)
    assert isinstance(trainer.strategy, L.strategies.ModelParallelStrategy)
    assert trainer.strategy.mesh_shape == (1, 2)
    trainer = L.Trainer(strategy=RayFSDPStrategy(num_workers=2, cpu_offload=True), logger=False)
    assert isinstance(trainer.strategy, L.strategies.ModelParallelStrategy) and trainer.strategy.cpu_offload is True
