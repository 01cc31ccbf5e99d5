"""The optimizers' and schedulers' settings after ``fit``, on the driver: what they read after a one-process fit.

The optimizers and schedulers live in the workers (their state is tensors the size of the model). Rank 0 sends
their settings home with the results: each param group's hyperparameters (``lr``, ``momentum``, ``betas``...),
each scheduler's plain state (``last_epoch``, ``_last_lr``, ``base_lrs``...) and its Lightning configuration
(``interval``, ``frequency``, ``monitor``...), never a tensor. The driver's ``trainer.optimizers`` and
``trainer.lr_scheduler_configs`` then hold stand-ins with those values (:class:`OptimizerSettings`,
:class:`SchedulerSettings`), so ``trainer.optimizers[0].param_groups[0]["lr"]`` reads the rate the fit ended with.
A stand-in cannot step: training happens in the workers.

Growth law: per optimizer, its param groups' settings (bytes, not the model's size); sent once per fit by rank 0.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ray_lightning import namespaces

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)
_CONFIG_FIELDS = ("name", "interval", "frequency", "reduce_on_plateau", "monitor", "strict")


def optimizer_settings(optimizers: Sequence[Any]) -> list[list[dict[str, Any]]]:
    """Each optimizer's param groups' settings (everything but the parameters) that are plain values."""
    return [
        [{k: v for k, v in group.items() if k != "params" and is_plain(v)} for group in optimizer.param_groups]
        for optimizer in optimizers
    ]


def is_plain(value: Any) -> bool:
    """A value without tensors: what the settings keep."""
    if isinstance(value, (tuple, list)):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and is_plain(v) for k, v in value.items())
    return value is None or isinstance(value, (bool, int, float, str))


def settings_for_driver(trainer: pl.Trainer) -> dict[str, Any] | None:
    """In rank 0 after a fit: its optimizers' and schedulers' settings (plain values only); None where they cannot
    be read (an engine's own optimizer without param groups): a convenience never fails the fit."""
    try:
        return _settings(trainer)
    except Exception as error:  # noqa: BLE001 - the driver then keeps no settings, as before
        log.debug("ray_lightning: the optimizers' settings stay in the workers: %s", error)
        return None


def _settings(trainer: pl.Trainer) -> dict[str, Any]:
    optimizers = list(trainer.optimizers)
    schedulers = []
    for config in getattr(trainer, "lr_scheduler_configs", []):
        scheduler = config.scheduler
        owner = getattr(scheduler, "optimizer", None)
        index = next((i for i, optimizer in enumerate(optimizers) if optimizer is owner), None)
        state = scheduler.state_dict() if hasattr(scheduler, "state_dict") else {}
        schedulers.append(
            {
                "class": type(scheduler).__name__,
                "optimizer": index,
                "state": {k: v for k, v in state.items() if is_plain(v)},
                "config": {name: getattr(config, name) for name in _CONFIG_FIELDS if hasattr(config, name)},
            }
        )
    return {
        "optimizers": [
            {
                "class": type(optimizer).__name__,
                "groups": groups,
                "defaults": _plain_dict(getattr(optimizer, "defaults", {})),
            }
            for optimizer, groups in zip(optimizers, optimizer_settings(optimizers))
        ],
        "schedulers": schedulers,
    }


def apply_on_driver(trainer: pl.Trainer, settings: dict[str, Any]) -> None:
    """The driver's ``trainer.optimizers`` and ``trainer.lr_scheduler_configs``: stand-ins with rank 0's settings."""
    optimizers = [OptimizerSettings(o["class"], o["groups"], o["defaults"]) for o in settings["optimizers"]]
    make_config = namespaces.of(trainer).pl("utilities.types.LRSchedulerConfig")
    configs = []
    for entry in settings["schedulers"]:
        index = entry["optimizer"]
        owner = optimizers[index] if index is not None and index < len(optimizers) else None
        configs.append(make_config(SchedulerSettings(entry["class"], entry["state"], owner), **entry["config"]))
    trainer.strategy.optimizers = optimizers
    trainer.strategy.lr_scheduler_configs = configs


@contextlib.contextmanager
def left_on_driver(trainer: pl.Trainer | None) -> Iterator[None]:
    """While the Trainer is pickled for the workers: without the stand-ins (the workers make their own optimizers;
    Lightning's optimizer wrappers of the stand-ins do not unpickle)."""
    strategy = getattr(trainer, "strategy", None)
    if strategy is None or not any(isinstance(o, OptimizerSettings) for o in strategy.optimizers):
        yield
        return
    optimizers, configs = strategy.optimizers, strategy.lr_scheduler_configs
    strategy.optimizers, strategy.lr_scheduler_configs = [], []
    try:
        yield
    finally:
        strategy.optimizers, strategy.lr_scheduler_configs = optimizers, configs


def _plain_dict(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if is_plain(v)}


class _Settings:
    """A stand-in of something that lived in the workers: its settings only."""

    _what = "optimizer"

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"ray_lightning: after fit the driver holds the {self._what}'s settings only; it stepped in the Ray "
            "workers. Train with trainer.fit."
        )


class OptimizerSettings(_Settings):
    """An optimizer of the fit as the driver sees it afterwards: ``param_groups`` (settings, no parameters) and
    ``defaults``; its state (momentum, Adam's moments) stayed in the workers."""

    def __init__(self, name: str, groups: list[dict[str, Any]], defaults: dict[str, Any]) -> None:
        self.name = name
        self.param_groups = [{**group, "params": []} for group in groups]
        self.defaults = dict(defaults)
        self.state: dict[Any, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": [dict(group) for group in self.param_groups]}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to zero: the driver holds no gradients of the fit."""

    def __repr__(self) -> str:
        groups = [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]
        return f"{self.name} after fit (settings; the state stayed in the workers): {groups}"


class SchedulerSettings(_Settings):
    """A learning-rate scheduler of the fit as the driver sees it afterwards: its plain state as attributes
    (``last_epoch``, ``base_lrs``...), ``get_last_lr()`` and ``state_dict()``."""

    _what = "scheduler"

    def __init__(self, name: str, state: dict[str, Any], optimizer: OptimizerSettings | None) -> None:
        self.__dict__.update(state)
        self._state_keys = list(state)
        self.name = name
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return {key: self.__dict__[key] for key in self._state_keys}

    def get_last_lr(self) -> list[float]:
        return list(self.__dict__.get("_last_lr", []))

    def __repr__(self) -> str:
        return f"{self.name} after fit (settings): {self.state_dict()}"
