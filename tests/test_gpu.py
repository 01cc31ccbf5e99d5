"""GPU training for real, where this machine has GPUs; skipped (saying why) where it has none.

The device logic these tests rely on (CUDA_VISIBLE_DEVICES, device index, backend) is also tested
without a GPU in test_environment.py.
"""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from ray_lightning import RayStrategy
from tests.models import BoringModel, Recorder, read_records

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.skipif(
        GPUS == 0, reason="no CUDA GPU on this machine; GPU paths are unit-tested in test_environment.py"
    ),
    pytest.mark.usefixtures("ray_gpu"),
]


@pytest.fixture
def ray_gpu():
    import ray

    if not ray.is_initialized() or ray.cluster_resources().get("GPU", 0) < GPUS:
        ray.shutdown()
        ray.init(num_cpus=8, num_gpus=GPUS)
    yield ray


def _fit(tmp_path, strategy) -> list[dict]:
    model = BoringModel()
    before = model.layer.weight.clone()
    trainer = pl.Trainer(
        max_epochs=1, strategy=strategy, callbacks=[Recorder(tmp_path)], logger=False, enable_progress_bar=False
    )
    trainer.fit(model)
    assert not torch.equal(before, model.layer.weight)
    assert model.layer.weight.device.type == "cpu", "weights on the driver should not need a GPU"
    return read_records(tmp_path, "fit", "start")


def test_one_gpu_worker_trains_on_cuda_with_nccl(tmp_path):
    (start,) = _fit(tmp_path, RayStrategy(num_workers=1, use_gpu=True))
    assert start["device"] == "cuda:0"
    assert start["backend"] == "nccl"
    assert start["resources"]["GPU"] == 1.0


@pytest.mark.skipif(GPUS == 1, reason="needs 2 GPUs; this machine has 1")
def test_two_gpu_workers_use_their_own_device(tmp_path):
    starts = _fit(tmp_path, RayStrategy(num_workers=2, use_gpu=True))
    assert sorted(s["device"] for s in starts) == ["cuda:0", "cuda:1"]
    assert {s["backend"] for s in starts} == {"nccl"}


@pytest.mark.skipif(GPUS > 1, reason="with several GPUs Ray may place the two halves on different devices")
def test_two_workers_sharing_one_gpu_use_gloo(tmp_path):
    starts = _fit(tmp_path, RayStrategy(num_workers=2, resources_per_worker={"GPU": 0.5}))
    assert {s["device"] for s in starts} == {"cuda:0"}
    assert {s["backend"] for s in starts} == {"gloo"}


def test_horovod_worker_trains_on_cuda(tmp_path):
    hvd = pytest.importorskip("horovod.torch", reason="Horovod is not installed")
    if not hvd.nccl_built():
        pytest.skip("this Horovod was built without NCCL (HOROVOD_GPU_OPERATIONS=NCCL); it cannot reduce CUDA tensors")
    from ray_lightning import HorovodRayStrategy

    (start,) = _fit(tmp_path, HorovodRayStrategy(num_workers=1, use_gpu=True))
    assert start["device"] == "cuda:0"
    assert start["resources"]["GPU"] == 1.0


# -- models bigger than one worker, on GPUs ------------------------------------------------------


def _fit_mlp(strategy, **trainer_kwargs):
    from tests.sharded_models import MLP

    pl.seed_everything(0)
    model = MLP()
    trainer = pl.Trainer(
        max_epochs=2, strategy=strategy, logger=False, enable_progress_bar=False, enable_model_summary=False,
        **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(model)
    return model, trainer


@pytest.fixture(scope="module")
def gpu_ddp_weights():
    model, _ = _fit_mlp(RayStrategy(num_workers=GPUS, use_gpu=True), enable_checkpointing=False)
    return model.state_dict()


def _sharded_gpu_strategies():
    from ray_lightning import RayDeepSpeedStrategy, RayFSDP1Strategy, RayFSDPStrategy

    yield "fsdp2", lambda: RayFSDPStrategy(num_workers=GPUS, use_gpu=True)
    yield "fsdp1-sharded", lambda: RayFSDP1Strategy(num_workers=GPUS, state_dict_type="sharded")
    yield "fsdp1-full", lambda: RayFSDP1Strategy(num_workers=GPUS)
    yield "deepspeed-stage3", lambda: RayDeepSpeedStrategy(num_workers=GPUS, use_gpu=True, stage=3)


@pytest.mark.parametrize("name, make", list(_sharded_gpu_strategies()), ids=lambda v: v if isinstance(v, str) else "")
def test_sharded_strategies_train_on_cuda_and_bring_the_full_weights_home(name, make, gpu_ddp_weights, tmp_path):
    if name.startswith("deepspeed"):
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    from pytorch_lightning.callbacks import ModelCheckpoint

    from tests.sharded_models import MLP

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt")
    model, trainer = _fit_mlp(make(), callbacks=[checkpoint])
    weights = model.state_dict()
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in weights.values()), name
    torch.testing.assert_close(weights, gpu_ddp_weights, rtol=1e-4, atol=1e-5)
    # The checkpoint (a file, or a directory of every rank's parts) is on this machine and tests on new workers.
    (result,) = pl.Trainer(strategy=make(), logger=False).test(MLP(), ckpt_path=checkpoint.best_model_path)
    assert result["test_loss"] > 0
