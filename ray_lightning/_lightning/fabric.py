"""Fabric's private names: how ``Fabric(strategy=RayStrategy(...))`` becomes a Fabric strategy on Ray actors.

Fabric has no hook for a strategy object of another class tree (a Trainer strategy) nor for a strategy
that brings the workers' accelerator, so, as for the Trainer (:mod:`.connector`):

* ``_Connector._check_config_and_set_final_flags`` (of ``lightning.fabric`` and ``lightning_fabric``) is
  wrapped: the strategy flag goes through the converter :mod:`ray_lightning.fabric` installs (a
  ray_lightning Trainer strategy, or a registered name such as ``"ray"``, becomes its Fabric strategy)
  and an ``accelerator=`` the Fabric strategy decides is checked there, then left to it.
* :class:`FabricStrategyHooks`: the private hooks of Fabric's strategies (``_setup_distributed``,
  ``_set_world_ranks``), forwarded to the public names the Trainer strategies already use.
* ``_do_nothing``: what ``fabric.launch()`` runs without a function (refused on Ray actors).
* DDP's ``_ddp_kwargs``: the ``DistributedDataParallel`` arguments a Trainer strategy keeps.
* DeepSpeed's ``_format_config``/``_config_initialized``: the config completed after meeting, which Fabric's
  ``_setup_distributed`` (replaced by ours) does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from typing_extensions import override

from ray_lightning import namespaces
from ray_lightning._lightning.strategy import LightningStrategyHooks
from ray_lightning.namespaces import Namespace

CONNECTOR = "connector._Connector"
WRAPPED = "_check_config_and_set_final_flags"
DO_NOTHING = "fabric._do_nothing"
DDP_KWARGS = "_ddp_kwargs"
DEEPSPEED_FORMAT_CONFIG = "_format_config"
DEEPSPEED_CONFIG_DONE = "_config_initialized"
# (Fabric strategy, flag) -> (strategy, accelerator): installed by ray_lightning.fabric.
Converter = Callable[[Any, Any, Namespace], tuple[Any, Any]]
_installed: set[Namespace] = set()


class FabricStrategyHooks(LightningStrategyHooks):
    """Mixed into a Fabric strategy subclass before Fabric's class: its private hooks, to our public names
    (``join_process_group`` and ``set_world_ranks``, which the Trainer strategies' mixin defines)."""

    @override
    def _setup_distributed(self) -> None:
        self.join_process_group()  # type: ignore[attr-defined]

    @override
    def _set_world_ranks(self) -> None:
        self.set_world_ranks()  # type: ignore[attr-defined]


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The ``DistributedDataParallel`` arguments a Lightning ``DDPStrategy`` (Trainer's or Fabric's) keeps."""
    return dict(getattr(strategy, DDP_KWARGS, None) or {})


def format_deepspeed_config(strategy: Any) -> None:
    """What Fabric's ``DeepSpeedStrategy._setup_distributed`` does after meeting: complete its DeepSpeed config once."""
    if not getattr(strategy, DEEPSPEED_CONFIG_DONE):
        getattr(strategy, DEEPSPEED_FORMAT_CONFIG)()
        setattr(strategy, DEEPSPEED_CONFIG_DONE, True)


def is_argumentless_launch(function: Any) -> bool:
    """Whether ``function``, as Fabric hands it to a launcher, is ``fabric.launch()`` without a function."""
    wrapped = function.args[0] if isinstance(function, functools.partial) and function.args else None
    return any(wrapped is ns.fabric(DO_NOTHING) for ns in namespaces.installed())


def install_connector(convert: Converter) -> None:
    """Wrap every installed Fabric's ``_Connector`` once, so that ``convert`` sees each strategy flag first."""
    for ns in namespaces.installed():
        if ns in _installed:
            continue
        connector = ns.fabric(CONNECTOR)
        original = getattr(connector, WRAPPED)

        def check(
            self: Any, strategy: Any, accelerator: Any, *args: Any, _ns: Namespace = ns, _o: Any = original, **kw: Any
        ) -> None:
            strategy, accelerator = convert(strategy, accelerator, _ns)
            _o(self, strategy, accelerator, *args, **kw)

        check.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(connector, WRAPPED, check)
        _installed.add(ns)


def private_names(ns: Namespace) -> list[tuple[str, str, Callable[[], Any]]]:
    """(where, name, owner) of every private Fabric name above, for :data:`~.names.PRIVATE_NAMES`."""
    fabric = ns.fabric_package
    module, _, name = DO_NOTHING.rpartition(".")
    return [
        (f"{fabric}.{CONNECTOR}", WRAPPED, lambda: ns.fabric(CONNECTOR)),
        (f"{fabric}.{module}", name, lambda: _import(f"{fabric}.{module}")),
        (f"{fabric}.strategies.DDPStrategy", "_setup_distributed", lambda: ns.fabric("strategies.DDPStrategy")),
        (f"{fabric}.strategies.DDPStrategy", "_set_world_ranks", lambda: ns.fabric("strategies.DDPStrategy")),
        (f"{fabric}.strategies.DDPStrategy", DDP_KWARGS, lambda: ns.fabric("strategies.DDPStrategy")()),
        (
            f"{fabric}.strategies.ModelParallelStrategy",
            "_setup_distributed",
            lambda: ns.fabric("strategies.ModelParallelStrategy"),
        ),
        (
            f"{fabric}.strategies.DeepSpeedStrategy",
            DEEPSPEED_FORMAT_CONFIG,
            lambda: ns.fabric("strategies.DeepSpeedStrategy"),
        ),
    ]


def _import(module: str) -> Any:
    import importlib

    return importlib.import_module(module)
