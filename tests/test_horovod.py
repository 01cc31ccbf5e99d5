"""HorovodRayStrategy / HorovodRayAccelerator: real Horovod over Gloo between real Ray actors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import GradientAccumulationScheduler, ModelCheckpoint

from examples.train_digits import DigitsClassifier, DigitsDataModule
from ray_lightning import (
    ClusterResourceError,
    HorovodRayAccelerator,
    HorovodRayStrategy,
    RayAccelerator,
    RayStrategy,
    RayWorkerError,
)
from ray_lightning.horovod.strategy import worker_layout
from tests.conftest import alive_worker_actors, wait_for
from tests.models import BoringModel, HorovodRanks, IndexedDataset, read_records
from tests.test_training import FailingModel

pytest.importorskip("horovod.torch", reason="Horovod is not installed: `python3 dev.py test` builds it")
pytestmark = pytest.mark.usefixtures("ray_local")


def _trainer(**kwargs) -> pl.Trainer:
    defaults = dict(max_epochs=2, enable_progress_bar=False, logger=False, enable_model_summary=False)
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


# -- arguments (no Ray needed) -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((None, None, None), (1, None)),
        ((3, None, None), (3, None)),
        ((None, 2, 4), (8, 2)),
        ((None, 2, None), (2, 2)),
        ((None, None, 3), (3, 1)),
    ],
)
def test_worker_layout(args, expected):
    assert worker_layout(*args) == expected


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_workers": 4, "num_hosts": 2}, ValueError, "either num_workers .* or num_hosts/num_slots"),
        ({"num_hosts": 0, "num_slots": 2}, ValueError, "num_hosts must be >= 1"),
        ({"num_slots": 1.5}, TypeError, "num_slots must be an int"),
        ({"num_workers": 2, "resources_per_worker": {"gpu": 1}}, ValueError, "Ray calls this resource 'GPU'"),
        ({"num_workers": 2, "init_hook": "not callable"}, TypeError, "init_hook"),
    ],
)
def test_bad_arguments_fail_in_the_constructor(kwargs, error, match):
    with pytest.raises(error, match=match):
        HorovodRayStrategy(**kwargs)
    with pytest.raises(error, match=match):
        HorovodRayAccelerator(**kwargs)


def test_hosts_and_slots_become_one_bundle_per_host_on_different_nodes():
    strategy = HorovodRayStrategy(num_hosts=2, num_slots=3, resources_per_worker={"CPU": 2, "custom_accel": 1})
    assert (strategy.num_workers, strategy.num_hosts, strategy.num_slots) == (6, 2, 3)
    bundles, placement = strategy.resources.placement()
    assert placement == "STRICT_SPREAD"
    assert bundles == [{"CPU": 6.0, "custom_accel": 3.0}] * 2
    assert [strategy.resources.bundle_index(i) for i in range(6)] == [0, 0, 0, 1, 1, 1]
    assert HorovodRayStrategy(num_workers=3).resources.placement()[1] == "PACK"


def test_ray_lightning_imports_without_horovod():
    code = (
        "import sys; sys.modules['horovod'] = None\n"  # as if Horovod were not installed
        "import ray_lightning\n"
        "ray_lightning.RayStrategy(num_workers=2)\n"
        "try:\n"
        "    ray_lightning.HorovodRayStrategy(num_workers=2)\n"
        "except ImportError as error:\n"
        "    print('ImportError:', error)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ImportError: HorovodRayStrategy needs Horovod" in out.stdout
    assert "dev.py test" in out.stdout


def test_horovod_extra_is_satisfied_by_the_installed_horovod(tmp_path):
    """`pip install ray_lightning[horovod]` where Horovod is installed must not try to build it again."""
    root = Path(__file__).resolve().parents[1]
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-build-isolation", "--quiet"]
    out = subprocess.run(
        [*cmd, "--report", str(report), f"{root}[horovod]"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    to_install = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert to_install == ["ray_lightning"], to_install


def test_missing_horovod_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod.torch", None)  # makes `import horovod.torch` fail
    with pytest.raises(ImportError, match=r"dev\.py test.*ray_lightning\[horovod\]"):
        HorovodRayStrategy(num_workers=2)
    with pytest.raises(ImportError, match="Installing Horovod"):
        pl.Trainer(strategy="horovod_ray", logger=False)
    # The rest of the package does not need Horovod.
    assert RayStrategy(num_workers=2).num_workers == 2


def test_accelerator_forms_resolve_to_the_horovod_strategy():
    accelerator = HorovodRayAccelerator(num_hosts=1, num_slots=2, cpus_per_worker=2)
    trainer = pl.Trainer(accelerator=accelerator, logger=False)
    assert isinstance(trainer.strategy, HorovodRayStrategy)
    assert trainer.accelerator is accelerator
    assert trainer.strategy.resources.cpus == 2 and trainer.strategy.num_workers == 2

    by_name = pl.Trainer(strategy="horovod_ray", logger=False)
    assert isinstance(by_name.strategy, HorovodRayStrategy)
    assert isinstance(by_name.accelerator, HorovodRayAccelerator)
    assert isinstance(pl.Trainer(accelerator="horovod_ray", logger=False).strategy, HorovodRayStrategy)

    with pytest.raises(ValueError, match="either accelerator=HorovodRayAccelerator.* or strategy=RayStrategy"):
        pl.Trainer(accelerator=HorovodRayAccelerator(num_workers=2), strategy=RayStrategy(num_workers=2))
    with pytest.raises(ValueError, match="HorovodRayAccelerator brings its own HorovodRayStrategy"):
        pl.Trainer(accelerator=HorovodRayAccelerator(num_workers=2), strategy="ddp")


def test_hosts_the_cluster_does_not_have_fail_at_once():
    # The session cluster is one node: two hosts can never be placed, so no waiting.
    trainer = _trainer(strategy=HorovodRayStrategy(num_hosts=2, num_slots=1, placement_timeout_s=600))
    with pytest.raises(ClusterResourceError, match="2 different nodes .* only 1 of the cluster's 1 node"):
        trainer.fit(BoringModel())


@pytest.mark.usefixtures("no_waiting_workers")
def test_gradient_accumulation_scheduler_is_refused_before_launch():
    trainer = _trainer(
        strategy=HorovodRayStrategy(num_workers=2), callbacks=[GradientAccumulationScheduler({0: 1, 1: 2})]
    )
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=N"):
        trainer.fit(BoringModel())
    assert not alive_worker_actors()


# -- training ------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [1, 2])
def test_fit_trains_with_horovod_and_brings_weights_and_metrics_back(num_workers, tmp_path):
    model = BoringModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(strategy=HorovodRayStrategy(num_workers=num_workers), callbacks=[HorovodRanks(tmp_path)])
    trainer.fit(model)

    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items()), "weights did not change"
    assert trainer.global_step == 2 * (64 // 8 // num_workers)
    assert set(trainer.callback_metrics) >= {"train_loss", "val_loss"}
    records = read_records(tmp_path, "fit", "horovod")
    assert [(r["hvd_rank"], r["hvd_size"]) for r in records] == [(r, num_workers) for r in range(num_workers)]
    assert {r["optimizer"] for r in records} == {"horovod.torch.optimizer"}, "optimizer not wrapped by Horovod"
    assert all(r["gloo_iface"] for r in records), "Gloo interface not chosen from the node IP"
    # Each rank's DistributedSampler follows its Horovod rank: disjoint shares covering the data.
    ends = read_records(tmp_path, "fit", "end")
    assert [(e["sampler"], e["num_replicas"], e["rank"]) for e in ends] == [
        ("DistributedSampler", num_workers, r) for r in range(num_workers)
    ]
    first_epoch = [set(e["indices"][0]) for e in ends]
    assert set().union(*first_epoch) == set(range(64))
    assert sum(len(s) for s in first_epoch) == 64


def test_horovod_and_ddp_train_the_same_module_identically():
    def run(strategy) -> dict:
        torch.manual_seed(3)
        model = BoringModel()
        _trainer(max_epochs=3, strategy=strategy).fit(model)
        return model.state_dict()

    horovod = run(HorovodRayStrategy(num_workers=2))
    ddp = run(RayStrategy(num_workers=2))
    for k in ddp:
        torch.testing.assert_close(horovod[k], ddp[k])


def test_accelerator_form_reaches_the_same_accuracy_as_ray_accelerator():
    def run(accelerator) -> float:
        pl.seed_everything(7)
        trainer = _trainer(max_epochs=6, accelerator=accelerator)
        trainer.fit(DigitsClassifier(), datamodule=DigitsDataModule())
        return float(trainer.callback_metrics["val_acc"])

    horovod = run(HorovodRayAccelerator(num_workers=2, cpus_per_worker=1, use_gpu=False))
    ddp = run(RayAccelerator(num_workers=2, cpus_per_worker=1, use_gpu=False))
    assert horovod > 0.9, horovod
    assert horovod == pytest.approx(ddp, abs=0.01)


class ManualModel(BoringModel):
    """Manual optimization: the module zeroes, back-propagates and steps itself."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y, _ = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.manual_backward(loss)
        optimizer.step()
        self.log("train_loss", loss)


class NoOptimizerModel(BoringModel):
    def configure_optimizers(self):
        return None


def test_manual_optimization_and_no_optimizer_match_ddp():
    def run(strategy, model_class) -> dict:
        torch.manual_seed(11)
        model = model_class()
        _trainer(max_epochs=2, strategy=strategy).fit(model)
        return model.state_dict()

    horovod, ddp = run(HorovodRayStrategy(num_workers=2), ManualModel), run(RayStrategy(num_workers=2), ManualModel)
    for k in ddp:
        torch.testing.assert_close(horovod[k], ddp[k])
    torch.manual_seed(11)
    untouched = NoOptimizerModel().state_dict()
    for k, v in run(HorovodRayStrategy(num_workers=2), NoOptimizerModel).items():
        torch.testing.assert_close(v, untouched[k])


class ScheduledModel(BoringModel):
    """SGD whose rate drops tenfold each epoch; logs the rate the optimizer really used."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, weight_decay=0.01)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)]

    def training_step(self, batch, batch_idx):
        self.log("lr_used", self.trainer.optimizers[0].param_groups[0]["lr"])
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_accumulation_and_lr_schedule_match_ddp_and_a_larger_batch(accumulate):
    """Accumulating 2 micro-batches of 4 equals one batch of 8; scheduler, momentum and decay apply as in DDP."""

    def run(strategy, batch_size: int, accumulate_grad_batches: int) -> tuple[dict, pl.Trainer]:
        torch.manual_seed(5)
        model = ScheduledModel(batch_size=batch_size)
        trainer = _trainer(max_epochs=3, strategy=strategy, accumulate_grad_batches=accumulate_grad_batches)
        trainer.fit(model)
        return model.state_dict(), trainer

    horovod, trainer = run(HorovodRayStrategy(num_workers=2), 8 // accumulate, accumulate)
    ddp_big_batch, ddp_trainer = run(RayStrategy(num_workers=2), 8, 1)

    assert trainer.global_step == ddp_trainer.global_step == 3 * 4
    assert float(trainer.callback_metrics["lr_used"]) == pytest.approx(0.05 * 0.1**2)
    for k in ddp_big_batch:
        torch.testing.assert_close(horovod[k], ddp_big_batch[k], rtol=1e-5, atol=1e-6)


class CollectivesModel(BoringModel):
    """Logs values that are only right if reduce / all_gather / broadcast really crossed the workers."""

    def validation_step(self, batch, batch_idx):
        rank = float(self.global_rank)
        self.log("rank_mean", torch.tensor(rank * 10 + 1), sync_dist=True)
        self.log("rank_sum", torch.tensor(rank + 1), sync_dist=True, reduce_fx="sum")
        self.log("rank_max", torch.tensor(rank), sync_dist=True, reduce_fx="max")
        return super().validation_step(batch, batch_idx)

    def on_validation_epoch_end(self):
        gathered = self.all_gather(torch.tensor([float(self.global_rank)]))
        self.log("gathered_rows", float(gathered.shape[0]), rank_zero_only=True)
        self.log("gathered_sum", gathered.sum(), rank_zero_only=True)
        self.log("broadcast_from_1", float(self.trainer.strategy.broadcast(self.global_rank + 100, src=1)))
        stop_everywhere = self.trainer.strategy.reduce_boolean_decision(self.global_rank == 1, all=False)
        self.log("any_rank_is_1", float(stop_everywhere))
        # Ranks holding objects of different types, as in `x if rank == 0 else None`.
        word = self.trainer.strategy.broadcast("from rank 0" if self.global_rank == 0 else None)
        self.log("broadcast_word_ok", float(word == "from rank 0"))


@pytest.mark.parametrize("strategy_class", [HorovodRayStrategy, RayStrategy])
def test_sync_dist_all_gather_and_broadcast_cross_the_workers(strategy_class):
    trainer = _trainer(max_epochs=1, strategy=strategy_class(num_workers=2))
    metrics = trainer.validate(CollectivesModel())[0]
    # 2 ranks x 4 validation batches of 8: rank 0 logs 1, rank 1 logs 11.
    assert metrics["rank_mean"] == pytest.approx(6.0)
    assert metrics["rank_sum"] == pytest.approx(4 * 1 + 4 * 2)
    assert metrics["rank_max"] == pytest.approx(1.0)
    assert metrics["gathered_rows"] == 2 and metrics["gathered_sum"] == pytest.approx(1.0)
    assert metrics["broadcast_from_1"] == 101
    assert metrics["any_rank_is_1"] == 1.0
    assert metrics["broadcast_word_ok"] == 1.0


class PreSteppedOptimizer(BoringModel):
    """Its optimizer already has momentum when training starts, and it differs between ranks."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        for p in self.parameters():
            p.grad = torch.full_like(p, float(self.global_rank + 1))
        optimizer.step()
        optimizer.zero_grad()
        return optimizer


class FinalWeights(pl.Callback):
    def __init__(self, directory) -> None:
        self.directory = str(directory)

    def on_train_end(self, trainer, pl_module):
        torch.save(pl_module.state_dict(), f"{self.directory}/weights-rank{trainer.global_rank}.pt")


def test_parameters_and_existing_optimizer_state_come_from_rank_zero(tmp_path):
    trainer = _trainer(max_epochs=1, strategy=HorovodRayStrategy(num_workers=2), callbacks=[FinalWeights(tmp_path)])
    trainer.fit(PreSteppedOptimizer())
    rank0, rank1 = (torch.load(tmp_path / f"weights-rank{r}.pt") for r in (0, 1))
    for k in rank0:
        torch.testing.assert_close(rank0[k], rank1[k], msg=f"ranks diverged in {k}")


def test_best_checkpoint_loads_and_resumes(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", save_last=True)
    trainer = _trainer(max_epochs=3, strategy=HorovodRayStrategy(num_workers=2), callbacks=[checkpoint])
    model = ScheduledModel(lr=0.02)
    trainer.fit(model)

    restored = ScheduledModel.load_from_checkpoint(checkpoint.best_model_path)
    assert restored.hparams.lr == 0.02
    last = torch.load(checkpoint.last_model_path, weights_only=False)
    torch.testing.assert_close(model.layer.weight, last["state_dict"]["layer.weight"])
    assert last["optimizer_states"][0]["state"], "Horovod optimizer state was not saved"

    resumed = _trainer(max_epochs=5, strategy=HorovodRayStrategy(num_workers=2))
    resumed.fit(ScheduledModel(lr=0.02), ckpt_path=checkpoint.last_model_path)
    assert resumed.current_epoch == 5
    assert resumed.global_step == last["global_step"] + 2 * 4
    # The schedule went on from the checkpoint: epoch 4 ran at 0.02 * 0.1**4.
    assert float(resumed.callback_metrics["lr_used"]) == pytest.approx(0.02 * 0.1**4)


def test_predict_returns_every_rank_in_dataset_order():
    model = BoringModel(size=61)
    predictions = _trainer(strategy=HorovodRayStrategy(num_workers=2)).predict(model)
    assert torch.cat([b["index"] for b in predictions]).tolist() == list(range(61))
    with torch.no_grad():
        expected = model(IndexedDataset(61, 8, seed=3).x)
    torch.testing.assert_close(torch.cat([b["pred"] for b in predictions]), expected)


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_failing_worker_surfaces_with_its_rank_then_next_fit_works(how):
    trainer = _trainer(max_epochs=1, strategy=HorovodRayStrategy(num_workers=2))
    with pytest.raises(RayWorkerError) as info:
        trainer.fit(FailingModel(fail_rank=1, how=how))
    assert info.value.rank == 1
    if how == "raise":
        assert "ValueError: boom on purpose in rank 1" in str(info.value)
    else:
        assert "died" in str(info.value)
    wait_for(lambda: not alive_worker_actors(), 30, "the failed fit's actors to be gone")

    model = BoringModel()
    before = model.layer.weight.clone()
    _trainer(max_epochs=1, strategy=HorovodRayStrategy(num_workers=2)).fit(model)
    assert not torch.equal(before, model.layer.weight)


class FinishMarker(pl.Callback):
    def __init__(self, path) -> None:
        self.path = str(path)

    def on_train_end(self, trainer, pl_module):
        open(f"{self.path}-rank{trainer.global_rank}", "w").close()


def test_failure_surfaces_while_the_other_workers_still_train(tmp_path):
    """A failing rank must not wait for its peers to finish (hvd.join would let them train on without it)."""
    trainer = _trainer(
        max_epochs=2000, strategy=HorovodRayStrategy(num_workers=2), callbacks=[FinishMarker(tmp_path / "done")]
    )
    with pytest.raises(RayWorkerError, match="boom on purpose in rank 1"):
        trainer.fit(FailingModel(fail_rank=1, how="raise"))
    assert not list(tmp_path.glob("done-*")), "the failure was only reported after rank 0 trained to the end"


def test_repeated_fits_with_one_strategy_continue_training_and_leave_no_actors():
    strategy = HorovodRayStrategy(num_workers=2, keep_workers_alive_s=0)
    model = BoringModel()
    losses = []
    # Two rounds: the second fit reuses the strategy after a test call, from the weights the first brought home.
    for _ in range(2):
        trainer = _trainer(max_epochs=1, strategy=strategy)
        trainer.fit(model)
        losses.append(trainer.test(model)[0]["test_loss"])
        wait_for(lambda: not alive_worker_actors(), 30, "this round's actors to be gone")
    assert losses[1] < losses[0], "training did not continue from the driver's weights"
