"""W&B, MLflow and Comet loggers on Ray workers (issue 16): real wandb offline, real MLflow file stores.

What a user checks: the driver's logger holds one run whose id does not change across ``fit``s,
the run has rank 0's metrics (and only rank 0's), the driver's config and checkpoints logged as
artifacts, a second ``fit`` continues its steps, and the run's files are on the driver's machine,
also when rank 0 ran on another node. W&B runs are read back from their offline run files
(:mod:`tests.wandb_records`), MLflow runs through ``MlflowClient``.
"""

from __future__ import annotations

import glob
import json
import os
import zipfile

import pytest
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

from ray_lightning import HorovodRayStrategy, RayAccelerator, RayStrategy
from tests.conftest import connected_cluster
from tests.models import BoringModel
from tests.wandb_records import offline_runs

wandb = pytest.importorskip("wandb")
pytest.importorskip("mlflow")
from pytorch_lightning.loggers import MLFlowLogger, WandbLogger  # noqa: E402 - after the skips

# Rank 0 trains 4 batches per epoch (64 samples, batches of 8, 2 workers).
STEPS_PER_EPOCH = 4


class LogsToWandbDirectly(BoringModel):
    """Also calls ``wandb.log`` itself, as modules written for W&B do."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.is_global_zero:
            wandb.log({"direct": float(self.global_step)})
        return loss


@pytest.fixture(autouse=True)
def _logger_environment(tmp_path, monkeypatch):
    """W&B's own directories under the test's; the driver's W&B service and variables gone afterwards."""
    for name in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    saved = {k: v for k, v in os.environ.items() if k.startswith("WANDB_")}
    yield
    wandb.teardown()
    for name in [k for k in os.environ if k.startswith("WANDB_")]:
        del os.environ[name]
    os.environ.update(saved)


def _trainer(strategy, logger, max_epochs: int = 2, **kwargs) -> pl.Trainer:
    if strategy is not None:
        kwargs["strategy"] = strategy
    return pl.Trainer(
        max_epochs=max_epochs,
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _steps(run, key: str = "train_loss") -> list[int]:
    return [step for step, _ in run.values(key)]


# -- W&B on the driver's machine ----------------------------------------------------------------


def test_wandb_offline_run_has_rank_zeros_metrics_and_the_next_fit_continues_it(ray_local, tmp_path):
    logger = WandbLogger(project="rl", save_dir="runs", offline=True)
    logger.experiment.config.update({"driver_cfg": 7})  # a run on the driver before fit
    run_id = logger.version
    trainer = _trainer(RayStrategy(num_workers=2), logger, enable_checkpointing=False)

    trainer.fit(LogsToWandbDirectly())
    assert logger.version == run_id
    assert wandb.run is None, "the driver holds no run while (or after) rank 0 logs"
    trainer.fit_loop.max_epochs = 3
    trainer.fit(LogsToWandbDirectly())
    assert logger.version == run_id and trainer.global_step == 3 * STEPS_PER_EPOCH

    # The driver's run before fit, then one run directory per fit: rank 1 wrote none.
    before, first, second = offline_runs(str(tmp_path / "runs"), run_id)
    assert all(run.run_id == run_id and run.finished for run in (before, first, second))
    assert before.history == [] and before.config["driver_cfg"] == 7
    for run in (first, second):
        assert run.config["driver_cfg"] == 7 and run.config["lr"] == 0.05  # the driver's and the module's
        assert run.values("direct"), "wandb.log from the module"
        assert run.values("val_loss")
    # Rank 0's batches only, and the second fit's steps follow the first's (as in Lightning).
    assert _steps(first) == list(range(2 * STEPS_PER_EPOCH))
    assert _steps(second) == list(range(2 * STEPS_PER_EPOCH, 3 * STEPS_PER_EPOCH))


# Fresh workers: once in four full runs, on workers whose process had run another W&B run, the offline run
# held one artifact of the two logged (wandb's own service, kept by the process); left alone, see CHANGELOG.
@pytest.mark.usefixtures("no_waiting_workers")
def test_wandb_log_model_logs_each_checkpoint_once_across_fits(ray_local, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # reaches the workers: Ray started without it
    logger = WandbLogger(project="rl", save_dir="runs", log_model=True)
    checkpoint = ModelCheckpoint(dirpath="ckpts", monitor="val_loss", save_top_k=3)
    trainer = _trainer(RayStrategy(num_workers=2), logger, callbacks=[checkpoint])

    trainer.fit(BoringModel())
    run_id = logger.version
    trainer.fit_loop.max_epochs = 3
    trainer.fit(BoringModel())

    first, second = offline_runs(str(tmp_path / "runs"), run_id)
    assert logger.version == run_id and first.run_id == run_id
    # log_model=True logs the kept checkpoints when training ends (logger.finalize, in rank 0),
    # the second fit only the one it added.
    assert [a["name"] for a in first.artifacts] == [f"model-{run_id}"] * 2
    assert [a["name"] for a in second.artifacts] == [f"model-{run_id}"]
    assert all(a["type"] == "model" and "latest" in a["aliases"] for a in first.artifacts + second.artifacts)
    assert len(os.listdir(tmp_path / "ckpts")) == 3


def _record_wandb_init():
    """init_hook: the next ``wandb.init`` in this worker records its arguments in the run's config.

    The online code path without a W&B server: the run itself is offline.
    """
    real_init = wandb.init

    def init(*args, **kwargs):
        wandb.init = real_init
        seen = {k: kwargs.get(k) for k in ("id", "resume", "dir", "project", "mode")}
        seen["env"] = {k: os.environ.get(k) for k in ("WANDB_SERVICE", "WANDB_MODE", "WANDB_API_KEY")}
        run = real_init(*args, **{**kwargs, "mode": "offline"})  # sets WANDB_SERVICE: its own service
        run.config.update({"init_call": seen})
        return run

    wandb.init = init


def test_wandb_online_rank_zero_resumes_the_drivers_run_id(ray_local, tmp_path, monkeypatch):
    # The driver's own W&B service socket must not reach the workers; an API key must.
    monkeypatch.setenv("WANDB_SERVICE", "3-1-unix-/nonexistent/socket")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    logger = WandbLogger(project="rl", save_dir="runs")
    trainer = _trainer(RayStrategy(num_workers=2, init_hook=_record_wandb_init), logger, enable_checkpointing=False)
    trainer.fit(BoringModel())

    run_id = logger.version
    (run,) = offline_runs(str(tmp_path / "runs"), run_id)
    assert run.config["init_call"] == {
        "id": run_id,
        "resume": "allow",
        "dir": str(tmp_path / "runs"),
        "project": "rl",
        "mode": None,  # online: W&B decides, as on the driver
        "env": {"WANDB_SERVICE": None, "WANDB_MODE": None, "WANDB_API_KEY": "k" * 40},
    }
    assert _steps(run) == list(range(2 * STEPS_PER_EPOCH))


def test_horovod_with_wandb(ray_local, tmp_path):
    pytest.importorskip("horovod.torch", reason="Horovod is not installed: `python3 dev.py test` builds it")
    logger = WandbLogger(project="rl", save_dir="runs", offline=True)
    trainer = _trainer(HorovodRayStrategy(num_workers=2), logger, max_epochs=1, enable_checkpointing=False)
    trainer.fit(BoringModel())
    (run,) = offline_runs(str(tmp_path / "runs"), logger.version)
    assert run.finished and _steps(run) == list(range(STEPS_PER_EPOCH))


def test_a_staged_wandb_run_does_not_overwrite_one_the_driver_has(tmp_path):
    from ray_lightning.home.loggers import wandb_run

    logger = WandbLogger(save_dir=str(tmp_path), id="abc12345", offline=True)
    taken = tmp_path / "wandb" / "offline-run-20260101_120000-abc12345"
    (taken.parent / f"{taken.name}-1").mkdir(parents=True)
    taken.mkdir()
    arriving = {str(taken / "run-abc12345.wandb"): b"rank 0's", str(tmp_path / "wandb" / "other.txt"): b"x"}
    assert wandb_run.arriving_files(logger, arriving) == {
        str(taken.parent / f"{taken.name}-2" / "run-abc12345.wandb"): b"rank 0's",
        str(tmp_path / "wandb" / "other.txt"): b"x",
    }


# -- MLflow and Comet on the driver's machine --------------------------------------------------


def _mlflow_client(store):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"file:{store}")


def _history(client, run_id: str, key: str) -> list[int]:
    return [m.step for m in client.get_metric_history(run_id, key)]


def test_mlflow_run_in_a_local_store_continues_in_the_next_fit(ray_local, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3.17 refuses file stores otherwise
    logger = MLFlowLogger(experiment_name="rl")  # file:./mlruns, in the driver's working directory
    # The classic form of the strategy: the same launch.
    trainer = _trainer(None, logger, accelerator=RayAccelerator(num_workers=2), enable_checkpointing=False)
    trainer.fit(BoringModel())
    run_id = logger.run_id
    trainer.fit_loop.max_epochs = 3
    trainer.fit(BoringModel())

    client = _mlflow_client(tmp_path / "mlruns")
    run = client.get_run(run_id)
    assert logger.run_id == run_id
    assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [run_id]
    assert run.info.status == "FINISHED" and run.data.params["lr"] == "0.05"
    assert _history(client, run_id, "train_loss") == list(range(3 * STEPS_PER_EPOCH))
    assert len(_history(client, run_id, "val_loss")) == 3


def test_comet_offline_archive_of_rank_zero_lands_on_the_driver(ray_local, tmp_path, monkeypatch):
    pytest.importorskip("comet_ml")
    from pytorch_lightning.loggers import CometLogger

    monkeypatch.setenv("COMET_START_ONLINE", "false")
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", "comet")
    logger = CometLogger(project="rl")
    key = logger.version
    trainer = _trainer(RayStrategy(num_workers=2), logger, enable_checkpointing=False)
    try:
        trainer.fit(BoringModel())
    finally:
        logger.experiment.end()
    archives = {}
    for path in glob.glob(str(tmp_path / "comet" / "*.zip")):
        with zipfile.ZipFile(path) as archive:
            messages = [json.loads(line) for line in archive.read("messages.json").decode().splitlines() if line]
        archives[path] = {m["payload"]["metric"]["metricName"] for m in messages if m.get("payload", {}).get("metric")}
    assert logger.version == key and all(os.path.basename(p).startswith(key) for p in archives)
    # The driver's archive and rank 0's, which has the metrics.
    assert len(archives) == 2 and any({"train_loss", "val_loss"} <= names for names in archives.values())


# -- rank 0 on another node ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_without_driver_slots():
    """The driver's node (no worker slots) and one other node with two."""
    with connected_cluster({"num_cpus": 2, "resources": {"worker_slot": 2}}) as cluster:
        yield cluster


def test_wandb_and_mlflow_runs_of_rank_zero_on_another_node_land_on_the_driver(
    cluster_without_driver_slots, tmp_path, monkeypatch
):
    # Workers on other nodes do not inherit the driver's environment: these are forwarded.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    wandb_logger = WandbLogger(project="rl", save_dir="runs", log_model="all")
    wandb_logger.experiment.config.update({"driver_cfg": 7})
    # MLflow caches a store per URI: a relative one made in another test's directory would be reused.
    mlflow_logger = MLFlowLogger(experiment_name="rl", save_dir=str(tmp_path / "mlruns"), log_model=True)
    checkpoint = ModelCheckpoint(dirpath="ckpts", save_top_k=-1)
    strategy = RayStrategy(num_workers=2, resources_per_worker={"CPU": 1, "worker_slot": 1})
    trainer = _trainer(strategy, [wandb_logger, mlflow_logger], callbacks=[checkpoint])
    run_id, mlflow_run = wandb_logger.version, mlflow_logger.run_id

    trainer.fit(LogsToWandbDirectly())
    transferred = trainer.strategy.launcher.transferred_files
    trainer.fit_loop.max_epochs = 3
    trainer.fit(LogsToWandbDirectly())

    assert (wandb_logger.version, mlflow_logger.run_id) == (run_id, mlflow_run)
    assert any(p.endswith(f"run-{run_id}.wandb") for p in transferred), "rank 0 ran on another node"
    before, first, second = offline_runs(str(tmp_path / "runs"), run_id)
    assert before.history == [] and first.finished and second.finished
    assert first.config["driver_cfg"] == 7 and first.values("direct")
    assert _steps(first) == list(range(2 * STEPS_PER_EPOCH))
    assert _steps(second) == list(range(2 * STEPS_PER_EPOCH, 3 * STEPS_PER_EPOCH))
    assert (len(first.artifacts), len(second.artifacts)) == (2, 1)  # log_model="all": at each save
    # Rank 0's W&B log did not overwrite the driver's through wandb/debug.log (a link to the latest run's).
    with open(os.path.join(os.path.dirname(before.path), "logs", "debug.log")) as f:
        assert "ray_lightning-staging" not in f.read()

    client = _mlflow_client(tmp_path / "mlruns")
    run = client.get_run(mlflow_run)
    assert run.info.status == "FINISHED" and run.data.params["lr"] == "0.05"
    assert _history(client, mlflow_run, "train_loss") == list(range(3 * STEPS_PER_EPOCH))
    # The checkpoints logged as artifacts are on the driver, where the run says they are.
    assert run.info.artifact_uri == f"file://{tmp_path}/mlruns/{run.info.experiment_id}/{mlflow_run}/artifacts"
    logged = sorted(a.path for a in client.list_artifacts(mlflow_run))
    assert logged == ["epoch=0-step=4", "epoch=1-step=8", "epoch=2-step=12"]
    artifacts = tmp_path / "mlruns" / run.info.experiment_id / mlflow_run / "artifacts"
    assert all((artifacts / name / f"{name}.ckpt").is_file() for name in logged)
