"""The classic ``Trainer(accelerator=RayAccelerator(...))`` form, and the connector methods it wraps.

``import ray_lightning`` wraps them (ray_lightning._lightning.connector); if a Lightning release renames
one, tests/test_lightning_internals.py names it.
"""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
from pytorch_lightning.strategies import SingleDeviceStrategy
from pytorch_lightning.trainer.connectors.accelerator_connector import _AcceleratorConnector

from ray_lightning import RayAccelerator, RayStrategy
from ray_lightning._lightning import connector
from tests.models import BoringModel


def test_the_wrapped_lightning_methods_exist_and_are_wrapped():
    for name in connector.WRAPPED:
        method = getattr(_AcceleratorConnector, name)
        assert hasattr(method, "__wrapped__"), f"_AcceleratorConnector.{name} is not wrapped"


def test_accelerator_form_builds_a_ray_strategy():
    accelerator = RayAccelerator(num_workers=3, cpus_per_worker=2, use_gpu=False, find_unused_parameters=True)
    trainer = pl.Trainer(accelerator=accelerator, logger=False)
    assert isinstance(trainer.strategy, RayStrategy)
    assert trainer.accelerator is accelerator
    assert trainer.strategy.num_workers == 3
    assert trainer.strategy.resources.cpus == 2
    assert trainer.strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert trainer.world_size == 3


def test_names_resolve_after_import():
    assert isinstance(pl.Trainer(strategy="ray", logger=False).strategy, RayStrategy)
    trainer = pl.Trainer(accelerator="ray", logger=False)
    assert isinstance(trainer.strategy, RayStrategy) and isinstance(trainer.accelerator, RayAccelerator)


def test_strategy_form_ignores_the_drivers_device_choice():
    strategy = RayStrategy(num_workers=2)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", logger=False)
    assert isinstance(trainer.accelerator, RayAccelerator)
    assert trainer.strategy.accelerator._strategy is trainer.strategy
    # This driver has no GPU; the workers' reservation decides, with a warning about the ignored flag.
    with pytest.warns(UserWarning, match=r"accelerator='gpu'\) is ignored: RayStrategy trains on CPU"):
        trainer = pl.Trainer(strategy=strategy, accelerator="gpu", logger=False)
    assert isinstance(trainer.accelerator, RayAccelerator) and trainer.strategy is strategy


def test_num_nodes_is_ignored_with_a_warning():
    with pytest.warns(UserWarning, match=r"num_nodes=2\) is ignored"):
        trainer = pl.Trainer(strategy=RayStrategy(num_workers=3), num_nodes=2, logger=False)
    assert trainer.world_size == 3


def test_accelerator_with_another_strategy_is_refused():
    with pytest.raises(ValueError, match="cannot be combined with strategy='ddp'"):
        pl.Trainer(accelerator=RayAccelerator(num_workers=2), strategy="ddp", logger=False)
    with pytest.raises(ValueError, match="Pass either accelerator=RayAccelerator"):
        pl.Trainer(accelerator=RayAccelerator(num_workers=2), strategy=RayStrategy(num_workers=2), logger=False)


def test_an_unconverted_accelerator_refuses_to_train_single_process(monkeypatch):
    # What a Lightning release that bypassed the hook would produce: RayAccelerator under a plain strategy.
    for name in connector.WRAPPED:
        monkeypatch.setattr(_AcceleratorConnector, name, getattr(_AcceleratorConnector, name).__wrapped__)
    trainer = pl.Trainer(accelerator=RayAccelerator(num_workers=2), logger=False, max_epochs=1)
    assert isinstance(trainer.strategy, SingleDeviceStrategy)
    with pytest.raises(RuntimeError, match="Refusing to train single-process"):
        trainer.fit(BoringModel())


def test_missing_lightning_internals_are_reported(monkeypatch):
    monkeypatch.setattr(connector, "_install_errors", {})
    monkeypatch.delattr(_AcceleratorConnector, "_choose_strategy")
    with pytest.raises(RuntimeError, match="has no _AcceleratorConnector._choose_strategy"):
        RayAccelerator(num_workers=2)
