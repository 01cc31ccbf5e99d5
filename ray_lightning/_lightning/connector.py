"""The patch of Lightning's private ``_AcceleratorConnector`` that makes ``accelerator=RayAccelerator(...)`` work.

Lightning 2.x accepts an ``Accelerator`` for ``Trainer(accelerator=...)`` and then chooses the
strategy itself; there is no public hook for an accelerator to bring its own strategy, nor for a
strategy to keep Lightning from judging devices by the driver's hardware (the driver of a GPU
cluster often has no GPU, and Lightning refuses DDP strategies on Apple-silicon laptops). Three
methods of the connector are wrapped:

* ``_check_config_and_set_final_flags``: with a strategy that chooses its accelerator
  (:class:`ChoosesItsAccelerator`: ``RayStrategy(...)``, or a registered name such as ``"ray"``),
  the strategy's own accelerator replaces ``accelerator=`` (``"auto"``, ``"cpu"``, ``"gpu"``...):
  the GPUs reserved for the workers decide the device, not the driver's hardware.
* ``_choose_strategy`` (called when ``strategy="auto"``): returns the strategy of an accelerator
  that brings one (:class:`BringsItsStrategy`: ``RayAccelerator``).
* ``_init_strategy``: refuses such an accelerator combined with any other strategy (``"ddp"`` would
  re-launch ``sys.argv`` instead of using Ray).

Both Lightning namespaces (``pytorch_lightning`` and ``lightning.pytorch``, see
:mod:`ray_lightning.namespaces`) are patched. In the first wrapper, a ray_lightning strategy or
accelerator of the other namespace is swapped for this namespace's, rebuilt from the same
arguments, before Lightning checks its type: ``ray_lightning.RayStrategy(...)`` works with either
Trainer.

The wrappers are installed when ``ray_lightning`` is imported. If a Lightning release renames or
removes these methods, creating a RayAccelerator raises, RayStrategy still works (its accelerator
setter takes over the device choice), and ``RayAccelerator.setup_device`` raises if training
ever starts outside a Ray worker, so a change can never silently train single-process.

The two Protocols keep this module below the strategies: it recognises them by what they do.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ray_lightning import namespaces
from ray_lightning.namespaces import Namespace

WRAPPED = ("_check_config_and_set_final_flags", "_choose_strategy", "_init_strategy")
# Per namespace: None once installed, else why it cannot be.
_install_errors: dict[Namespace, str | None] = {}


@runtime_checkable
class ChoosesItsAccelerator(Protocol):
    """A strategy that decides the Trainer's accelerator (every ray_lightning strategy)."""

    def prepare_for_trainer(self, requested: Any) -> Any:
        """Called as a Trainer is built with this strategy and ``accelerator=requested``; returns the accelerator."""


@runtime_checkable
class BringsItsStrategy(Protocol):
    """An accelerator that brings its own strategy (``RayAccelerator``)."""

    def make_strategy(self) -> Any:
        """The strategy this accelerator stands for."""


def connector_class(ns: Namespace | None = None) -> Any:
    """Lightning's ``_AcceleratorConnector`` class (of ``ns``, default the primary namespace), or None if it moved."""
    try:
        return (ns or namespaces.primary()).pl("trainer.connectors.accelerator_connector._AcceleratorConnector")
    except (ImportError, AttributeError):
        return None


def _registered_strategy(ns: Namespace, name: str) -> Any:
    """The strategy registered as ``name`` if it chooses its accelerator (it must be built before Lightning looks)."""
    registry = ns.pl("strategies.StrategyRegistry")
    name = name.lower()
    if name not in registry:
        return None
    cls = registry[name]["strategy"]
    # Only ours are built here: building others (DeepSpeed...) may import what is not installed.
    return registry.get(name) if isinstance(cls, type) and issubclass(cls, ChoosesItsAccelerator) else None


def _refuse_other_strategy(connector: Any, accelerator: Any) -> None:
    flag = connector._strategy_flag
    shown = repr(flag) if isinstance(flag, str) else f"{type(flag).__name__}(...)"
    accel = type(accelerator).__name__
    strategy_name = accelerator.strategy_class.__name__
    raise ValueError(
        f"Trainer(accelerator={accel}(...)) cannot be combined with strategy={shown}: "
        f"the {accel} brings its own {strategy_name}. "
        f"Drop the strategy argument, or pass strategy={strategy_name}(...) without the {accel}."
    )


def _for_namespace(ns: Namespace, flag: Any) -> Any:
    """A ray_lightning strategy or accelerator of the other Lightning namespace, rebuilt for ``ns``."""
    if isinstance(flag, (ChoosesItsAccelerator, BringsItsStrategy)) and hasattr(flag, "init_arguments"):
        return namespaces.rebuild_for(flag, ns)
    return flag


def _install(ns: Namespace) -> None:
    connector = connector_class(ns)
    missing = [name for name in WRAPPED if connector is None or not callable(getattr(connector, name, None))]
    if missing:
        _install_errors[ns] = (
            f"{ns} {ns.version} has no _AcceleratorConnector.{', '.join(missing)}, which "
            "ray_lightning uses to turn Trainer(accelerator=RayAccelerator(...)) into a RayStrategy. "
            f"Use Trainer(strategy=RayStrategy(...)) instead, or a {ns.distribution} version ray_lightning supports."
        )
        return
    original_check = connector._check_config_and_set_final_flags
    original_choose = connector._choose_strategy
    original_init = connector._init_strategy

    def _check_config_and_set_final_flags(
        self: Any, strategy: Any, accelerator: Any, *args: Any, **kwargs: Any
    ) -> None:
        strategy, accelerator = _for_namespace(ns, strategy), _for_namespace(ns, accelerator)
        if isinstance(strategy, str):
            strategy = _registered_strategy(ns, strategy) or strategy
        if isinstance(strategy, ChoosesItsAccelerator):
            accelerator = strategy.prepare_for_trainer(accelerator)
        original_check(self, strategy, accelerator, *args, **kwargs)

    def _choose_strategy(self: Any) -> Any:
        accelerator = getattr(self, "accelerator", None)
        if isinstance(accelerator, BringsItsStrategy):
            return accelerator.make_strategy()
        return original_choose(self)

    def _init_strategy(self: Any) -> None:
        original_init(self)
        accelerator = getattr(self, "accelerator", None)
        if isinstance(accelerator, BringsItsStrategy) and not isinstance(self.strategy, ChoosesItsAccelerator):
            _refuse_other_strategy(self, accelerator)

    for name, original, wrapper in (
        ("_check_config_and_set_final_flags", original_check, _check_config_and_set_final_flags),
        ("_choose_strategy", original_choose, _choose_strategy),
        ("_init_strategy", original_init, _init_strategy),
    ):
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(connector, name, wrapper)
    _install_errors[ns] = None


def install(ns: Namespace | None = None) -> bool:
    """Install the wrappers once in ``ns`` (default: every installed namespace); False if a Lightning
    version there no longer has what they wrap."""
    for each in (ns,) if ns is not None else namespaces.installed():
        if each not in _install_errors:
            _install(each)
    return all(_install_errors[each] is None for each in ((ns,) if ns is not None else namespaces.installed()))


def ensure_installed(ns: Namespace | None = None) -> None:
    """Install the wrappers once; raise if this Lightning version no longer has what they wrap."""
    if not install(ns):
        raise RuntimeError("; ".join(e for e in _install_errors.values() if e))


def raise_not_converted(accelerator: Any) -> None:
    """Called when an accelerator that brings its strategy reached training without it."""
    ns = namespaces.of(accelerator)
    raise RuntimeError(
        f"{accelerator!r} reached training outside a Ray worker: the Trainer did not turn it into a "
        f"RayStrategy ({ns} {ns.version} may have changed how it chooses strategies). "
        "Refusing to train single-process. Use Trainer(strategy=RayStrategy(...)) instead."
    )
