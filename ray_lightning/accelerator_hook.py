"""The one place where ray_lightning touches Lightning internals.

Lightning 2.x accepts an ``Accelerator`` for ``Trainer(accelerator=...)`` and then chooses the
strategy itself; there is no public hook for an accelerator to bring its own strategy, nor for a
strategy to keep Lightning from judging devices by the driver's hardware (the driver of a GPU
cluster often has no GPU, and Lightning refuses DDP strategies on Apple-silicon laptops). This
module wraps three methods of Lightning's private ``_AcceleratorConnector``:

* ``_check_config_and_set_final_flags``: with ``strategy=RayStrategy(...)`` (or ``"ray"``;
  likewise ``HorovodRayStrategy``/``"horovod_ray"``), the strategy's own RayAccelerator replaces
  ``accelerator=`` (``"auto"``, ``"cpu"``, ``"gpu"``...): the GPUs reserved for the workers decide
  the device, not the driver's hardware.
* ``_choose_strategy`` (called when ``strategy="auto"``): returns a RayAccelerator's (or
  HorovodRayAccelerator's) strategy.
* ``_init_strategy``: refuses a RayAccelerator combined with any other strategy (``"ddp"`` would
  re-launch ``sys.argv`` instead of using Ray).

The wrappers are installed when ``ray_lightning`` is imported. If a Lightning release renames or
removes these methods, creating a RayAccelerator raises, RayStrategy still works (its accelerator
setter takes over the device choice), and ``RayAccelerator.setup_device`` raises if training
ever starts outside a Ray worker, so a change can never silently train single-process.
``tests/test_accelerator_hook.py`` fails when any wrapped method disappears.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl

_WRAPPED = ("_check_config_and_set_final_flags", "_choose_strategy", "_init_strategy")
# Strategy names that must be built before Lightning sees them, so their accelerator can be chosen.
_STRATEGY_NAMES = ("ray", "horovod_ray")
_install_error: str | None = None
_installed = False


def _connector_class() -> Any:
    from pytorch_lightning.trainer.connectors import accelerator_connector

    return getattr(accelerator_connector, "_AcceleratorConnector", None)


def _install() -> None:
    global _install_error, _installed
    connector = _connector_class()
    missing = [name for name in _WRAPPED if connector is None or not callable(getattr(connector, name, None))]
    if missing:
        _install_error = (
            f"pytorch_lightning {pl.__version__} has no _AcceleratorConnector.{', '.join(missing)}, which "
            "ray_lightning uses to turn Trainer(accelerator=RayAccelerator(...)) into a RayStrategy. "
            "Use Trainer(strategy=RayStrategy(...)) instead, or a pytorch_lightning version ray_lightning supports."
        )
        return

    original_check = connector._check_config_and_set_final_flags
    original_choose = connector._choose_strategy
    original_init = connector._init_strategy

    def _check_config_and_set_final_flags(
        self: Any, strategy: Any, accelerator: Any, *args: Any, **kwargs: Any
    ) -> None:
        from pytorch_lightning.strategies import StrategyRegistry

        from ray_lightning.strategy_base import RayWorkersMixin

        if isinstance(strategy, str) and strategy.lower() in _STRATEGY_NAMES:
            strategy = StrategyRegistry.get(strategy.lower())
        if isinstance(strategy, RayWorkersMixin):
            accelerator = strategy._prepare_for_trainer(accelerator)
        original_check(self, strategy, accelerator, *args, **kwargs)

    def _choose_strategy(self: Any) -> Any:
        from ray_lightning.accelerator import RayAccelerator

        accelerator = getattr(self, "accelerator", None)
        if isinstance(accelerator, RayAccelerator):
            return accelerator.make_strategy()
        return original_choose(self)

    def _init_strategy(self: Any) -> None:
        from ray_lightning.accelerator import RayAccelerator
        from ray_lightning.strategy_base import RayWorkersMixin

        original_init(self)
        accelerator = getattr(self, "accelerator", None)
        if isinstance(accelerator, RayAccelerator) and not isinstance(self.strategy, RayWorkersMixin):
            flag = self._strategy_flag
            shown = repr(flag) if isinstance(flag, str) else f"{type(flag).__name__}(...)"
            accel = type(accelerator).__name__
            strategy_name = accelerator._strategy_class().__name__
            raise ValueError(
                f"Trainer(accelerator={accel}(...)) cannot be combined with strategy={shown}: "
                f"the {accel} brings its own {strategy_name}. "
                f"Drop the strategy argument, or pass strategy={strategy_name}(...) without the {accel}."
            )

    _check_config_and_set_final_flags.__wrapped__ = original_check  # type: ignore[attr-defined]
    _choose_strategy.__wrapped__ = original_choose  # type: ignore[attr-defined]
    _init_strategy.__wrapped__ = original_init  # type: ignore[attr-defined]
    connector._check_config_and_set_final_flags = _check_config_and_set_final_flags
    connector._choose_strategy = _choose_strategy
    connector._init_strategy = _init_strategy
    _installed = True


def install() -> bool:
    """Install the wrappers once; False if this Lightning version no longer has what they wrap."""
    if not _installed and _install_error is None:
        _install()
    return _installed


def ensure_installed() -> None:
    """Install the wrappers once; raise if this Lightning version no longer has what they wrap."""
    if not install():
        raise RuntimeError(_install_error)


def raise_not_converted(accelerator: Any) -> None:
    raise RuntimeError(
        f"{accelerator!r} reached training outside a Ray worker: the Trainer did not turn it into a "
        f"RayStrategy (pytorch_lightning {pl.__version__} may have changed how it chooses strategies). "
        "Refusing to train single-process. Use Trainer(strategy=RayStrategy(...)) instead."
    )
