"""GPU training for real, where this machine has GPUs; skipped (saying why) where it has none.

Everything here runs with one GPU (the tests that need two say so when they skip): a single-GPU worker
(NCCL with world size 1, its device and CUDA_VISIBLE_DEVICES), two workers sharing the GPU (gloo), FSDP1,
FSDP2 and DeepSpeed, bf16-mixed precision, a restart after SIGKILL, a Tune trial and a Fabric launch.
``python3 dev.py gpu`` runs this module and writes its report. The device logic these tests rely on
(CUDA_VISIBLE_DEVICES, device index, backend) is also tested without a GPU in test_environment.py.
"""

from __future__ import annotations

import copy

import pytest
import pytorch_lightning as pl
import torch

from ray_lightning import RayStrategy
from tests.conftest import session_pythonpath
from tests.models import BoringModel, Recorder, read_records

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.skipif(
        GPUS == 0, reason="no CUDA GPU on this machine; GPU paths are unit-tested in test_environment.py"
    ),
    pytest.mark.usefixtures("ray_gpu"),
]


@pytest.fixture(scope="module")
def ray_gpu():
    """A local Ray with this machine's GPUs (also for the module-scoped fits below)."""
    import ray

    if not ray.is_initialized() or ray.cluster_resources().get("GPU", 0) < GPUS:
        ray.shutdown()
        # Tune's trial processes import this module by name.
        runtime_env = {"env_vars": {"PYTHONPATH": session_pythonpath()}}
        ray.init(address="local", num_cpus=8, num_gpus=GPUS, runtime_env=runtime_env)
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
    assert (start["world_size"], start["global_rank"], start["local_rank"]) == (1, 0, 0)
    assert start["device"] == "cuda:0"
    assert start["backend"] == "nccl"
    assert start["resources"]["GPU"] == 1.0
    # The worker sees exactly the GPU Ray reserved for it, as device 0.
    (gpu_id,) = start["gpu_ids"]
    assert start["cuda_visible_devices"] == gpu_id
    assert start["cuda_device_count"] == 1
    assert start["precision_device"] in (None, "cuda"), start


@pytest.mark.skipif(GPUS == 1, reason="needs 2 GPUs; this machine has 1")
def test_two_gpu_workers_use_their_own_device(tmp_path):
    starts = _fit(tmp_path, RayStrategy(num_workers=2, use_gpu=True))
    assert sorted(s["device"] for s in starts) == ["cuda:0", "cuda:1"]
    assert {s["backend"] for s in starts} == {"nccl"}


@pytest.mark.skipif(GPUS > 1, reason="with several GPUs Ray may place the two halves on different devices")
def test_two_workers_sharing_one_gpu_use_gloo(tmp_path):
    starts = _fit(tmp_path, RayStrategy(num_workers=2, resources_per_worker={"GPU": 0.5}))
    assert [(s["global_rank"], s["world_size"]) for s in starts] == [(0, 2), (1, 2)]
    assert {s["device"] for s in starts} == {"cuda:0"}
    assert {s["backend"] for s in starts} == {"gloo"}
    assert {s["resources"]["GPU"] for s in starts} == {0.5}
    # Both were given the same GPU, and see only it.
    assert len({tuple(s["gpu_ids"]) for s in starts}) == 1
    assert {s["cuda_visible_devices"] for s in starts} == {starts[0]["gpu_ids"][0]}


def test_nccl_on_one_shared_gpu_is_refused_before_anything_starts():
    # NCCL refuses two ranks on one device: said when the strategy is made, not as the workers fail.
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one device"):
        RayStrategy(num_workers=2, resources_per_worker={"GPU": 0.5}, process_group_backend="nccl")


class PrecisionProbe(BoringModel):
    """Logs what the forward pass computed in, and on which device: seen on the driver as callback metrics."""

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        out = self(x)
        self.log("forward_is_bf16", float(out.dtype == torch.bfloat16))
        self.log("on_cuda", float(out.device.type == "cuda"))
        return torch.nn.functional.mse_loss(out.float(), y)


def test_bf16_mixed_precision_on_the_gpu_worker(tmp_path):
    if not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name()} does not support bfloat16")
    model = PrecisionProbe()
    before = model.layer.weight.clone()
    trainer = pl.Trainer(
        max_epochs=1, precision="bf16-mixed", strategy=RayStrategy(num_workers=1, use_gpu=True),
        callbacks=[Recorder(tmp_path)], logger=False, enable_progress_bar=False,
    )  # fmt: skip
    trainer.fit(model)
    (start,) = read_records(tmp_path, "fit", "start")
    assert (start["precision"], start["precision_device"], start["device"]) == ("MixedPrecision", "cuda", "cuda:0")
    assert trainer.callback_metrics["forward_is_bf16"] == 1.0 and trainer.callback_metrics["on_cuda"] == 1.0
    # Mixed precision keeps float32 weights, and they trained.
    assert model.layer.weight.dtype == torch.float32 and not torch.equal(before, model.layer.weight)


def test_a_killed_gpu_worker_restarts_on_the_gpu_and_the_fit_ends_as_without_the_failure(tmp_path):
    from tests.test_restarts import FailsOnce, _trainer

    def fit(directory, marker):
        pl.seed_everything(0)
        model = FailsOnce(str(marker), rank=0, checkpoint_step=4)  # the only rank: SIGKILLed at epoch 1, batch 2, once
        trainer = _trainer(directory, RayStrategy(num_workers=1, use_gpu=True, max_failures=1),
                           callbacks=[Recorder(directory)])  # fmt: skip
        trainer.fit(model)
        return model, trainer

    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    (reference_dir / "marker").write_text("")  # the marker exists: nothing fails
    reference, _ = fit(reference_dir, reference_dir / "marker")
    model, trainer = fit(tmp_path, tmp_path / "killed")

    assert (tmp_path / "killed").exists(), "the worker was never killed"
    (restart,) = trainer.strategy.restarts
    assert (restart.rank, restart.reason, restart.number) == (0, "worker died", 1)
    # Resumed from epoch 0's checkpoint: 8 steps per epoch (64 samples, batch 8, 1 worker).
    assert (restart.epoch, restart.global_step) == (1, 8)
    assert (trainer.current_epoch, trainer.global_step) == (3, 24)
    pids = [line.split()[1] for line in (tmp_path / "killed.pids").read_text().splitlines()]
    assert len(pids) == 2 and pids[0] != pids[1], "a new process for the new attempt"
    # The new attempt (its record replaced the first's) trained on the GPU again.
    (start,) = read_records(tmp_path, "fit", "start")
    assert (start["device"], start["backend"], start["pid"]) == ("cuda:0", "nccl", int(pids[1]))
    torch.testing.assert_close(model.layer.weight, reference.layer.weight)


def train_on_a_gpu(config):
    """A Tune trial: one worker on a GPU, its metrics reported to Tune."""
    from ray_lightning.tune import TuneReportCallback

    trainer = pl.Trainer(
        max_epochs=2, strategy=RayStrategy(num_workers=1, use_gpu=True),
        callbacks=[TuneReportCallback({"loss": "val_loss", "on_cuda": "on_cuda"})],
        logger=False, enable_progress_bar=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(PrecisionProbe(lr=config["lr"]))


def test_a_tune_trial_trains_on_the_gpu(tmp_path):
    from ray import tune

    import ray_lightning
    from ray_lightning.tune import get_tune_resources

    # Workers an earlier test left waiting hold the GPU, which the trial (another process) cannot take over.
    ray_lightning.release_idle_workers()
    resources = get_tune_resources(num_workers=1, use_gpu=True)
    assert resources.required_resources["GPU"] == 1.0
    analysis = tune.run(
        train_on_a_gpu, config={"lr": 0.05}, resources_per_trial=resources, storage_path=str(tmp_path), verbose=0
    )
    (trial,) = analysis.trials
    assert trial.status == "TERMINATED", trial.error_file
    assert trial.last_result["training_iteration"] == 2
    assert trial.last_result["on_cuda"] == 1.0
    assert 0 < trial.last_result["loss"] < float("inf")


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
def gpu_ddp_weights(ray_gpu):
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
    (expected,) = pl.Trainer(accelerator="cpu", devices=1, logger=False).test(copy.deepcopy(model), verbose=False)
    (result,) = pl.Trainer(strategy=make(), logger=False).test(MLP(), ckpt_path=checkpoint.best_model_path)
    assert result["test_loss"] == pytest.approx(expected["test_loss"], rel=1e-3), name


class RayDataProbe(pl.LightningModule):
    """Logs where each RayDataModule batch arrived (its tensors on the worker's GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        self.log(
            "batch_on_cuda", float(batch["x"].device.type == "cuda"), reduce_fx="min", on_epoch=True, on_step=False
        )
        self.log("rows", float(len(batch["id"])), reduce_fx="sum", on_epoch=True, on_step=False)
        return self.layer(batch["x"]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_ray_data_batches_arrive_on_the_gpu_worker_s_device(tmp_path):
    pytest.importorskip("pyarrow", reason="Ray Data needs pyarrow, which this Python lacks")
    from ray_lightning.data import RayDataModule
    from tests.test_data import dataset

    trainer = pl.Trainer(
        max_epochs=1, strategy=RayStrategy(num_workers=1, use_gpu=True), logger=False, enable_progress_bar=False
    )
    trainer.fit(RayDataProbe(), datamodule=RayDataModule(train=dataset(64, preprocess=True), batch_size=8))
    assert trainer.callback_metrics["batch_on_cuda"] == 1.0
    assert trainer.callback_metrics["rows"] == 64


def fabric_on_the_gpu(fabric) -> dict:
    model = torch.nn.Linear(8, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(16, 8, device=fabric.device)
    with fabric.autocast():
        inner = str(model.module(x).dtype)
    fabric.backward(model(x).float().pow(2).mean())
    optimizer.step()
    total = fabric.all_reduce(torch.ones(1, device=fabric.device), reduce_op="sum")
    backend = torch.distributed.get_backend()
    return {"device": str(fabric.device), "inner": inner, "backend": backend, "sum": total.item()}


@pytest.mark.parametrize("fabric_package", ["lightning.fabric", "lightning_fabric"])
def test_fabric_launches_on_the_gpu_worker_with_nccl_and_bf16(fabric_package):
    import importlib

    fabric_class = importlib.import_module(fabric_package).Fabric
    fabric = fabric_class(strategy=RayStrategy(num_workers=1, use_gpu=True), precision="bf16-mixed")
    result = fabric.launch(fabric_on_the_gpu)
    assert result == {"device": "cuda:0", "inner": "torch.bfloat16", "backend": "nccl", "sum": 1.0}
