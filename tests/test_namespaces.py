"""Both Lightning namespaces: ``lightning.pytorch`` (``pip install lightning``) and ``pytorch_lightning``.

Every test runs once for each namespace installed here, with only that namespace's classes: its
Trainer, LightningModule, loggers, callbacks and LightningCLI. This file is also the smoke subset of
``python3 dev.py matrix``, run in venvs with only ``lightning``, only ``pytorch-lightning``, or both,
on the oldest and newest versions of the supported window: it imports nothing from the other tests.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ray_lightning
from ray_lightning import namespaces
from ray_lightning.tune import TuneReportCheckpointCallback, get_tune_resources

INSTALLED = [ns.trainer_package for ns in namespaces.installed()]
ROOT = Path(__file__).resolve().parents[1]


def lightning(name: str):
    return importlib.import_module(name)


def make_module(pl):
    """A LightningModule class of namespace ``pl`` (a linear regressor on generated data)."""

    class Regressor(pl.LightningModule):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.layer(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.mse_loss(self.layer(x), y), sync_dist=True)

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test_loss", F.mse_loss(self.layer(x), y), sync_dist=True)

        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            return self.layer(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    return Regressor


def data(size: int = 64) -> DataLoader:
    x = torch.randn(size, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)


def _trainer(pl, **kwargs):
    defaults = dict(max_epochs=1, enable_progress_bar=False, enable_model_summary=False)
    return pl.Trainer(**{**defaults, **kwargs})


@pytest.mark.parametrize("name", INSTALLED)
def test_fit_test_predict_with_this_namespace(name, ray_local, tmp_path):
    pl = lightning(name)
    module = make_module(pl)()
    before = module.layer.weight.detach().clone()
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", save_top_k=1)
    logger = pl.loggers.CSVLogger(tmp_path / "logs", name="run")
    trainer = _trainer(
        pl, max_epochs=2, strategy=ray_lightning.RayStrategy(num_workers=2), callbacks=[checkpoint], logger=logger
    )
    trainer.fit(module, data(), data())

    assert namespaces.of(trainer.strategy).trainer_package == name
    assert isinstance(trainer.strategy, ray_lightning.RayStrategy)
    assert not torch.equal(before, module.layer.weight), "the trained weights did not come home"
    assert "val_loss" in trainer.callback_metrics and trainer.current_epoch == 2
    assert Path(checkpoint.best_model_path).parent == tmp_path / "ckpt", checkpoint.best_model_path
    restored = type(module).load_from_checkpoint(checkpoint.best_model_path)
    saved = torch.load(checkpoint.best_model_path, weights_only=False)["state_dict"]["layer.weight"]
    assert torch.equal(restored.layer.weight, saved) and restored.hparams.lr == 0.1
    assert (Path(logger.log_dir) / "metrics.csv").read_text().count("val_loss") >= 1

    tested = trainer.test(module, data())
    assert tested and "test_loss" in tested[0]
    predictions = trainer.predict(module, data(size=40))
    assert sum(len(p) for p in predictions) == 40
    expected = module.layer(next(iter(data(size=40)))[0]).detach()
    assert torch.allclose(predictions[0], expected, atol=1e-6), "predictions out of dataset order"


# Form outermost: the forms with the same workers (the 1-worker registry defaults) run one after another.
@pytest.mark.parametrize("name", INSTALLED)
@pytest.mark.parametrize("form", ["RayAccelerator", "strategy='ray'", "accelerator='ray'"])
def test_every_form_with_this_namespace(name, form, ray_local):
    pl = lightning(name)
    kwargs = {
        "RayAccelerator": dict(accelerator=ray_lightning.RayAccelerator(num_workers=2)),
        "strategy='ray'": dict(strategy="ray"),
        "accelerator='ray'": dict(accelerator="ray"),
    }[form]
    module = make_module(pl)()
    before = module.layer.weight.detach().clone()
    trainer = _trainer(pl, logger=False, enable_checkpointing=False, **kwargs)
    trainer.fit(module, data())
    assert namespaces.of(trainer.strategy).trainer_package == name
    assert isinstance(trainer.strategy, pl.strategies.DDPStrategy)
    assert not torch.equal(before, module.layer.weight)


@pytest.mark.parametrize("name", INSTALLED)
def test_horovod_with_this_namespace(name, ray_local):
    pytest.importorskip("horovod.torch", reason="Horovod is not built for this torch")
    pl = lightning(name)
    module = make_module(pl)()
    before = module.layer.weight.detach().clone()
    trainer = _trainer(pl, logger=False, enable_checkpointing=False, strategy="horovod_ray")
    trainer.fit(module, data())
    assert isinstance(trainer.strategy, ray_lightning.HorovodRayStrategy)
    assert namespaces.of(trainer.strategy).trainer_package == name
    assert not torch.equal(before, module.layer.weight)


def train_in_trial(config):
    pl = lightning(config["namespace"])
    trainer = _trainer(
        pl,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        strategy=ray_lightning.RayStrategy(num_workers=1),
        callbacks=[TuneReportCheckpointCallback({"loss": "val_loss"}, on="validation_end")],
    )
    trainer.fit(make_module(pl)(lr=config["lr"]), data(), data())


@pytest.mark.parametrize("name", INSTALLED)
def test_tune_trial_with_checkpoints(name, ray_local, tmp_path):
    from ray import tune

    tuner = tune.Tuner(
        tune.with_resources(train_in_trial, get_tune_resources(num_workers=1)),
        param_space={"namespace": name, "lr": 0.05},
        tune_config=tune.TuneConfig(metric="loss", mode="min"),
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0),
    )
    result = tuner.fit().get_best_result()
    assert result.error is None, result.error
    assert result.metrics["training_iteration"] == 2 and result.metrics["loss"] >= 0
    with result.checkpoint.as_directory() as directory:
        state = torch.load(os.path.join(directory, "checkpoint"), weights_only=False)
    assert state["epoch"] == 1 and "state_dict" in state


@pytest.mark.parametrize("name", INSTALLED)
def test_lightning_cli_of_this_namespace(name, ray_local):
    pytest.importorskip("jsonargparse")
    pl = lightning(name)
    cli_module = importlib.import_module(f"{name}.cli")

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            return data()

    args = [
        "--trainer.strategy=ray_lightning.RayStrategy",
        "--trainer.strategy.num_workers=2",
        "--trainer.max_epochs=1",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
    ]
    cli = cli_module.LightningCLI(make_module(pl), Data, args=args, run=False, save_config_callback=None)
    before = cli.model.layer.weight.detach().clone()
    cli.trainer.fit(cli.model, cli.datamodule)
    assert namespaces.of(cli.trainer.strategy).trainer_package == name
    assert cli.trainer.strategy.num_workers == 2
    assert not torch.equal(before, cli.model.layer.weight)


@pytest.mark.skipif(len(INSTALLED) < 2, reason="needs both lightning and pytorch-lightning installed")
def test_both_trainers_in_one_process(ray_local):
    """The normal case: both packages installed, and both Trainers used with the same ray_lightning classes."""
    strategy = ray_lightning.RayStrategy(num_workers=2)
    for name in INSTALLED:
        pl = lightning(name)
        module = make_module(pl)()
        before = module.layer.weight.detach().clone()
        trainer = _trainer(pl, logger=False, enable_checkpointing=False, strategy=strategy)
        trainer.fit(module, data())
        assert namespaces.of(trainer.strategy).trainer_package == name
        assert not torch.equal(before, module.layer.weight)


@pytest.mark.skipif(len(INSTALLED) < 2, reason="needs both lightning and pytorch-lightning installed")
def test_a_subclass_serves_both_namespaces():
    class MyStrategy(ray_lightning.RayStrategy):
        def marked(self) -> str:
            return "mine"

    strategy = MyStrategy(num_workers=1, find_unused_parameters=True)
    for name in INSTALLED:
        pl = lightning(name)
        assert issubclass(MyStrategy, pl.strategies.Strategy)  # what LightningCLI checks of a class_path
        trainer = pl.Trainer(strategy=strategy, logger=False, enable_checkpointing=False)
        assert namespaces.of(trainer.strategy).trainer_package == name
        assert isinstance(trainer.strategy, MyStrategy) and trainer.strategy.marked() == "mine"
        assert trainer.strategy.init_arguments["find_unused_parameters"] is True


def test_without_lightning_the_import_says_what_to_install():
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_fabric'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import ray_lightning\n"
    )
    result = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode != 0
    assert "ImportError: ray_lightning needs PyTorch Lightning: `pip install lightning`" in result.stderr


def _import_with(setup: str) -> subprocess.CompletedProcess:
    code = setup + "\nimport ray_lightning\nprint('primary', ray_lightning.namespaces.primary())\n"
    return subprocess.run(
        [sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def test_too_old_versions_name_the_version_needed():
    # Only the version strings are changed: what an older release reports.
    old_lightning = "".join(f"import {n}; {n}.__version__ = '2.3.3'\n" for n in INSTALLED)
    result = _import_with(old_lightning)
    assert result.returncode != 0
    assert f"found {INSTALLED[0]} 2.3.3 (ray_lightning needs 2.4 or newer)" in result.stderr, result.stderr
    result = _import_with("import ray; ray.__version__ = '2.49.0'")
    assert "ImportError: Ray 2.49.0 (ray_lightning needs 2.50 or newer): pip install 'ray[default,tune]>=2.50'" in (
        result.stderr
    )
    result = _import_with("import torch; torch.__version__ = '2.3.1'")
    assert "ImportError: torch 2.3.1 (ray_lightning needs 2.4 or newer)" in result.stderr


def _sharding_refusal(make, **resources) -> str | None:
    try:
        make(num_workers=2, **resources)
    except ImportError as error:
        return str(error)
    return None


@pytest.mark.parametrize("name", ["RayFSDPStrategy", "RayModelParallelStrategy"])
def test_sharded_strategies_say_which_torch_they_need_when_made(name, monkeypatch):
    make = getattr(ray_lightning, name)
    # On this torch, for real: FSDP2 needs 2.6 with NCCL (a GPU per worker) and 2.9 over gloo (CPUs, a
    # shared GPU); the matrix's torch corners run both sides.
    version = namespaces.version_tuple(torch.__version__)
    for resources, minimum in (
        ({"use_gpu": True}, namespaces.SHARDING_TORCH),
        ({"use_gpu": False}, namespaces.GLOO_SHARDING_TORCH),
        ({"resources_per_worker": {"GPU": 0.5}}, namespaces.GLOO_SHARDING_TORCH),
    ):
        refusal = _sharding_refusal(make, **resources)
        if version >= minimum:
            assert refusal is None, refusal
        else:
            assert refusal and f"{name} needs torch {minimum[0]}.{minimum[1]} or newer" in refusal, refusal
    # What an older torch reports; the other strategies are made on it.
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    ray_lightning.RayStrategy(num_workers=2)
    assert f"{name} needs torch 2.6 or newer" in _sharding_refusal(make, use_gpu=True)
    monkeypatch.setattr(torch, "__version__", "2.8.0")
    assert "needs torch 2.9 or newer (FSDP2 over gloo" in _sharding_refusal(make, use_gpu=False)
    assert "needs torch 2.9 or newer" in _sharding_refusal(make, use_gpu=True, process_group_backend="gloo")


@pytest.mark.skipif(len(INSTALLED) < 2, reason="needs both lightning and pytorch-lightning installed")
def test_an_old_package_beside_a_new_one_is_left_out_with_a_warning():
    primary, other = INSTALLED
    result = _import_with(f"import {primary}; {primary}.__version__ = '1.9.5'")
    assert result.returncode == 0, result.stderr
    assert f"ray_lightning ignores {primary} 1.9.5 (ray_lightning needs 2.4 or newer)" in result.stderr
    assert f"primary {other}" in result.stdout
