"""Training, evaluation and prediction on real Ray workers with real gloo DDP."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader

from examples.train_digits import DigitsClassifier, DigitsDataModule
from ray_lightning import RayAccelerator, RayStrategy, RayWorkerError
from tests.conftest import alive_worker_actors, wait_for
from tests.models import BoringModel, IndexedDataset, Recorder, read_records

pytestmark = pytest.mark.usefixtures("ray_local")


def _trainer(**kwargs) -> pl.Trainer:
    defaults = dict(max_epochs=2, enable_progress_bar=False, logger=False, enable_model_summary=False)
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


@pytest.mark.parametrize("num_workers", [1, 2])
def test_fit_brings_trained_weights_and_state_back(num_workers, tmp_path):
    model = BoringModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = _trainer(strategy=RayStrategy(num_workers=num_workers), callbacks=[checkpoint])

    trainer.fit(model)

    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "driver's weights did not change"
    # The driver holds exactly what rank 0 saved at the end of training.
    last = torch.load(checkpoint.last_model_path, weights_only=False)["state_dict"]
    for k in after:
        torch.testing.assert_close(after[k], last[k])
    steps_per_epoch = 64 // 8 // num_workers
    assert trainer.current_epoch == 2
    assert trainer.global_step == 2 * steps_per_epoch
    assert trainer.state.finished and trainer.state.fn == "fit"
    assert set(trainer.callback_metrics) >= {"train_loss", "val_loss"}
    assert "train_loss" in trainer.logged_metrics


def test_both_api_forms_train_the_same_model_to_the_same_accuracy():
    def run(**trainer_kwargs) -> tuple[float, dict]:
        pl.seed_everything(7)
        model = DigitsClassifier()
        trainer = _trainer(max_epochs=6, **trainer_kwargs)
        trainer.fit(model, datamodule=DigitsDataModule())
        return float(trainer.callback_metrics["val_acc"]), model.state_dict()

    acc_strategy, weights_strategy = run(strategy=RayStrategy(num_workers=2, num_cpus_per_worker=1))
    acc_accel, weights_accel = run(accelerator=RayAccelerator(num_workers=2, cpus_per_worker=1, use_gpu=False))

    assert acc_strategy > 0.9, acc_strategy
    assert acc_accel == pytest.approx(acc_strategy, abs=1e-6)
    for k in weights_strategy:
        torch.testing.assert_close(weights_strategy[k], weights_accel[k])


def test_best_checkpoint_loads_on_driver(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", save_top_k=2)
    trainer = _trainer(max_epochs=3, strategy=RayStrategy(num_workers=2), callbacks=[checkpoint])
    trainer.fit(BoringModel(lr=0.02))

    assert os.path.isfile(checkpoint.best_model_path)
    assert len(checkpoint.best_k_models) == 2
    assert checkpoint.best_model_score == min(checkpoint.best_k_models.values())
    restored = BoringModel.load_from_checkpoint(checkpoint.best_model_path)
    assert restored.hparams.lr == 0.02
    saved = torch.load(checkpoint.best_model_path, weights_only=False)
    assert saved["callbacks"], "checkpoint carries callback state"
    torch.testing.assert_close(restored.layer.weight, saved["state_dict"]["layer.weight"])

    # "best" resolves on the workers from the state that came back to the driver.
    tested = trainer.test(BoringModel(lr=0.02), ckpt_path="best")[0]["test_loss"]
    with torch.no_grad():
        test_set = IndexedDataset(64, 8, seed=2)
        expected = torch.nn.functional.mse_loss(restored(test_set.x), test_set.y)
    assert tested == pytest.approx(float(expected), rel=1e-5)

    # A new Trainer resumes from the checkpoint and trains on to its own max_epochs.
    resumed = _trainer(max_epochs=5, strategy=RayStrategy(num_workers=2))
    resumed.fit(BoringModel(lr=0.02), ckpt_path=checkpoint.best_model_path)
    assert resumed.current_epoch == 5
    assert resumed.global_step == saved["global_step"] + (5 - saved["epoch"] - 1) * 4


@pytest.mark.parametrize("size", [64, 61])  # 61: ranks get unequal shares
def test_predict_returns_every_rank_in_dataset_order(size):
    model = BoringModel(size=size)
    trainer = _trainer(strategy=RayStrategy(num_workers=2))
    predictions = trainer.predict(model)

    indices = torch.cat([batch["index"] for batch in predictions])
    assert indices.tolist() == list(range(size))
    assert [len(batch["index"]) for batch in predictions][:-1] == [8] * (len(predictions) - 1)
    dataset = IndexedDataset(size, 8, seed=3)
    with torch.no_grad():
        expected = model(dataset.x)
    torch.testing.assert_close(torch.cat([batch["pred"] for batch in predictions]), expected)


class TwoPredictLoaders(BoringModel):
    def predict_dataloader(self):
        return [
            DataLoader(IndexedDataset(24, 8, seed=3), batch_size=8),
            DataLoader(IndexedDataset(40, 8, seed=4), batch_size=5),
        ]


def test_predict_with_two_dataloaders_and_without_returning():
    model = TwoPredictLoaders()
    trainer = _trainer(strategy=RayStrategy(num_workers=2))
    first, second = trainer.predict(model)
    assert torch.cat([b["index"] for b in first]).tolist() == list(range(24))
    assert torch.cat([b["index"] for b in second]).tolist() == list(range(40))
    assert {len(b["index"]) for b in second} == {5}
    assert trainer.predict(model, return_predictions=False) is None


def test_validate_and_test_return_metrics_of_all_ranks():
    model = BoringModel()
    trainer = _trainer(strategy=RayStrategy(num_workers=2))
    test_results = trainer.test(model)
    val_results = trainer.validate(model)

    with torch.no_grad():
        test_set, val_set = IndexedDataset(64, 8, seed=2), IndexedDataset(64, 8, seed=1)
        expected_test = torch.nn.functional.mse_loss(model(test_set.x), test_set.y)
        expected_val = torch.nn.functional.mse_loss(model(val_set.x), val_set.y)
    assert test_results[0]["test_loss"] == pytest.approx(float(expected_test), rel=1e-5)
    assert val_results[0]["val_loss"] == pytest.approx(float(expected_val), rel=1e-5)
    assert trainer.callback_metrics["val_loss"] == pytest.approx(float(expected_val), rel=1e-5)


def test_early_stopping_stops_and_reports_its_state():
    stopper = EarlyStopping(monitor="val_loss", patience=1)
    trainer = _trainer(max_epochs=10, strategy=RayStrategy(num_workers=2), callbacks=[stopper])
    trainer.fit(BoringModel(lr=0.0))  # no learning: val_loss never improves

    assert trainer.current_epoch == 2
    assert stopper.stopped_epoch == 1
    assert stopper.wait_count == 1


class UnusedParameterModel(BoringModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.unused = torch.nn.Linear(8, 1)


def test_unused_parameters_need_the_ddp_kwarg():
    with pytest.raises(RayWorkerError, match="find_unused_parameters"):
        _trainer(max_epochs=1, strategy=RayStrategy(num_workers=2)).fit(UnusedParameterModel())

    model = UnusedParameterModel()
    before = model.layer.weight.clone()
    trainer = _trainer(max_epochs=1, strategy=RayStrategy(num_workers=2, find_unused_parameters=True))
    trainer.fit(model)
    assert not torch.equal(before, model.layer.weight)


class LoaderWorkersModel(BoringModel):
    def test_dataloader(self):
        return DataLoader(IndexedDataset(64, 8, seed=2), batch_size=8, num_workers=2, persistent_workers=True)

    def train_dataloader(self):
        return DataLoader(IndexedDataset(64, 8, seed=0), batch_size=8, num_workers=2)


def test_dataloader_workers_in_fit_and_test_loop():
    model = LoaderWorkersModel()
    trainer = _trainer(max_epochs=1, strategy=RayStrategy(num_workers=2))
    trainer.fit(model)
    results = trainer.test(model)
    assert results and "test_loss" in results[0]


def test_distributed_sampler_splits_data_and_reshuffles_each_epoch(tmp_path):
    trainer = _trainer(max_epochs=2, strategy=RayStrategy(num_workers=2), callbacks=[Recorder(tmp_path)])
    trainer.fit(BoringModel())

    ends = read_records(tmp_path, "fit", "end")
    assert len(ends) == 2
    assert {e["sampler"] for e in ends} == {"DistributedSampler"}
    assert sorted(e["rank"] for e in ends) == [0, 1] and {e["num_replicas"] for e in ends} == {2}
    for epoch in range(2):
        shares = [set(e["indices"][epoch]) for e in ends]
        assert not shares[0] & shares[1], "ranks saw the same samples"
        assert shares[0] | shares[1] == set(range(64))
    for e in ends:
        assert e["indices"][0] != e["indices"][1], "no reshuffle between epochs"


class PrepareDataModule(pl.LightningDataModule):
    def __init__(self, directory):
        super().__init__()
        self.directory = str(directory)

    def prepare_data(self):
        import ray

        node = ray.get_runtime_context().get_node_id()
        with open(os.path.join(self.directory, f"prepared-{node}-{os.getpid()}"), "w"):
            pass

    def train_dataloader(self):
        return DataLoader(IndexedDataset(32, 8), batch_size=8)

    def val_dataloader(self):
        return DataLoader(IndexedDataset(32, 8, seed=1), batch_size=8)


def test_prepare_data_runs_once_per_node(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    trainer = _trainer(max_epochs=1, strategy=RayStrategy(num_workers=2))
    trainer.fit(BoringModel(), datamodule=PrepareDataModule(marks))
    assert len(list(marks.iterdir())) == 1


def test_precision_and_determinism_settings_reach_the_workers(tmp_path):
    trainer = _trainer(
        max_epochs=1,
        strategy=RayStrategy(num_workers=2),
        precision="bf16-mixed",
        deterministic=True,
        callbacks=[Recorder(tmp_path)],
    )
    try:
        model = BoringModel()
        before = model.layer.weight.clone()
        trainer.fit(model)
    finally:
        torch.use_deterministic_algorithms(False)
    starts = read_records(tmp_path, "fit", "start")
    assert {(s["precision"], s["precision_device"]) for s in starts} == {("MixedPrecision", "cpu")}
    assert {s["deterministic"] for s in starts} == {True}
    assert not torch.equal(before, model.layer.weight)


def test_gpu_zero_in_resources_wins_over_use_gpu(tmp_path):
    # The cluster has no GPU: training can only start because resources_per_worker's GPU: 0 wins.
    strategy = RayStrategy(num_workers=2, use_gpu=True, resources_per_worker={"GPU": 0})
    _trainer(max_epochs=1, strategy=strategy, callbacks=[Recorder(tmp_path)]).fit(BoringModel())
    starts = read_records(tmp_path, "fit", "start")
    assert {s["device"] for s in starts} == {"cpu"}
    assert {s["backend"] for s in starts} == {"gloo"}
    assert all("GPU" not in s["resources"] for s in starts)
    assert {s["cuda_visible_devices"] for s in starts} == {""}
    assert [(s["gpu_ids"], s["cuda_device_count"]) for s in starts] == [([], 0), ([], 0)]


def test_ranks_hook_and_progress_bar_on_one_node(tmp_path):
    def hook():
        os.environ["RAY_LIGHTNING_TEST_HOOK"] = "ran"

    strategy = RayStrategy(num_workers=2, init_hook=hook)
    _trainer(max_epochs=1, strategy=strategy, enable_progress_bar=True, callbacks=[Recorder(tmp_path)]).fit(
        BoringModel()
    )
    starts = read_records(tmp_path, "fit", "start")
    assert [(s["global_rank"], s["local_rank"], s["node_rank"]) for s in starts] == [(0, 0, 0), (1, 1, 0)]
    assert {s["world_size"] for s in starts} == {2}
    assert {s["env_hook"] for s in starts} == {"ran"}
    assert len({s["pid"] for s in starts}) == 2 and os.getpid() not in {s["pid"] for s in starts}
    # Lightning's bar is drawn by rank 0 only.
    assert [s["progress_bar_enabled"] for s in starts] == [True, False]


class FailingModel(BoringModel):
    def __init__(self, fail_rank: int, how: str):
        super().__init__()
        self.fail_rank = fail_rank
        self.how = how

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.fail_rank and batch_idx == 1:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"boom on purpose in rank {self.global_rank}")
        return super().training_step(batch, batch_idx)


def test_worker_exception_is_raised_with_rank_and_traceback_then_next_fit_works():
    trainer = _trainer(max_epochs=1, strategy=RayStrategy(num_workers=2))
    with pytest.raises(RayWorkerError) as info:
        trainer.fit(FailingModel(fail_rank=1, how="raise"))
    assert info.value.rank == 1
    message = str(info.value)
    assert "rank 1" in message and "ValueError: boom on purpose in rank 1" in message
    assert "training_step" in message, "the worker's traceback is missing"
    assert isinstance(info.value.__cause__, ValueError)
    wait_for(lambda: not alive_worker_actors(), 30, "the failed fit's actors to be gone")

    model = BoringModel()
    before = model.layer.weight.clone()
    _trainer(max_epochs=1, strategy=RayStrategy(num_workers=2)).fit(model)
    assert not torch.equal(before, model.layer.weight)


def test_killed_worker_gives_an_error_not_a_hang():
    trainer = _trainer(max_epochs=1, strategy=RayStrategy(num_workers=2))
    with pytest.raises(RayWorkerError, match="rank 1 .*died") as info:
        trainer.fit(FailingModel(fail_rank=1, how="kill"))
    assert info.value.rank == 1
    wait_for(lambda: not alive_worker_actors(), 30, "the killed fit's actors to be gone")


def test_logger_output_is_where_the_drivers_logger_points(tmp_path):
    from pytorch_lightning.loggers import CSVLogger

    (tmp_path / "logs" / "lightning_logs" / "version_0").mkdir(parents=True)  # an earlier run
    trainer = pl.Trainer(
        max_epochs=2,
        strategy=RayStrategy(num_workers=2),
        logger=CSVLogger(tmp_path / "logs"),
        log_every_n_steps=1,
        enable_progress_bar=False,
    )
    trainer.fit(BoringModel())
    assert trainer.logger.version == 1
    metrics = (tmp_path / "logs" / "lightning_logs" / "version_1" / "metrics.csv").read_text()
    assert "val_loss" in metrics and "train_loss" in metrics
    assert os.path.dirname(trainer.checkpoint_callback.best_model_path).startswith(trainer.logger.log_dir)


def test_concurrent_fits_on_one_node_get_their_own_rendezvous(tmp_path):
    """Like parallel Tune trials: two 2-worker fits at once from one process."""
    from concurrent.futures import ThreadPoolExecutor

    def fit(name: str) -> bool:
        model = BoringModel()
        before = model.layer.weight.clone()
        trainer = _trainer(max_epochs=2, strategy=RayStrategy(num_workers=2), callbacks=[Recorder(tmp_path, name)])
        trainer.fit(model)
        return not torch.equal(before, model.layer.weight)

    with ThreadPoolExecutor(2) as pool:
        changed = list(pool.map(fit, ["a", "b"]))
    assert changed == [True, True]
    masters = {name: {s["master"] for s in read_records(tmp_path, name, "start")} for name in ("a", "b")}
    assert len(masters["a"]) == len(masters["b"]) == 1, "the workers of one fit must share one rendezvous"
    assert masters["a"] != masters["b"]


def test_repeated_fits_and_tests_leave_no_actors_without_keep_alive():
    model = BoringModel()
    losses = []
    # Two rounds: the second fit starts after a test call, from the weights the first fit brought home.
    for _ in range(2):
        trainer = _trainer(max_epochs=1, strategy=RayStrategy(num_workers=2, keep_workers_alive_s=0))
        trainer.fit(model)
        losses.append(trainer.test(model)[0]["test_loss"])
        wait_for(lambda: not alive_worker_actors(), 30, "this round's actors to be gone")
    assert losses[1] < losses[0], "training did not continue from the driver's weights"


class UnpicklableModel(BoringModel):
    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()


@pytest.mark.usefixtures("no_waiting_workers")
def test_unpicklable_module_names_the_attribute():
    trainer = _trainer(max_epochs=1, strategy=RayStrategy(num_workers=2))
    with pytest.raises(TypeError, match=r"UnpicklableModel\.lock.*cannot be pickled"):
        trainer.fit(UnpicklableModel())
    assert not alive_worker_actors()


# -- other worker shapes: last, so that the tests above share the waiting 2-worker group ----------------


def test_actor_resources_follow_the_request(tmp_path):
    strategy = RayStrategy(num_workers=2, num_cpus_per_worker=1, resources_per_worker={"CPU": 2, "custom_accel": 1})
    _trainer(max_epochs=1, strategy=strategy, callbacks=[Recorder(tmp_path)]).fit(BoringModel())
    starts = read_records(tmp_path, "fit", "start")
    assert [s["resources"] for s in starts] == [{"CPU": 2.0, "custom_accel": 1.0}] * 2


class CountsPickling:
    """Counts, in the driver process, how often it is pickled."""

    count = 0

    def __getstate__(self):
        type(self).count += 1
        return {}


def test_trainer_and_module_are_serialized_once_for_all_workers():
    model = BoringModel()
    model.probe = CountsPickling()
    CountsPickling.count = 0
    _trainer(max_epochs=1, strategy=RayStrategy(num_workers=3)).fit(model)
    assert CountsPickling.count == 1
