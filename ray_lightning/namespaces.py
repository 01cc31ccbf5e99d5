"""The two Lightnings: ``pytorch_lightning`` and ``lightning.pytorch``, and ray_lightning written once for both.

Lightning ships the same code as two distributions: ``pytorch-lightning`` (modules
``pytorch_lightning`` and ``lightning_fabric``) and ``lightning`` (``lightning.pytorch`` and
``lightning.fabric``). Their classes are distinct: a ``lightning.pytorch.Trainer`` refuses a strategy
that subclasses ``pytorch_lightning``'s ``Strategy``, and Lightning's ``is_overridden`` refuses a
``pytorch_lightning`` callback. ray_lightning's code is written once against this module:

* :class:`Namespace` finds a Lightning name in one of the two (``ns.pl("callbacks.ModelCheckpoint")``).
  :func:`installed` lists those importable here; :func:`of` tells which one an object belongs to;
  :func:`every` gives a name from all of them, for ``isinstance``.
* :func:`family` makes one class, written once without a Lightning base, a subclass of a Lightning
  base in *every* installed namespace. The member of the :func:`primary` namespace is the public
  class (``ray_lightning.RayStrategy``); ``isinstance(x, RayStrategy)`` holds for every member, and a
  Trainer of another namespace swaps a member for its own, rebuilt from the same arguments
  (:mod:`ray_lightning._lightning.connector`). Members are module attributes
  (``RayStrategy__lightning``), so Ray pickles them by reference.
* Callbacks pass through no hook of ours, so ray_lightning's callbacks subclass every installed
  namespace's ``Callback`` at once (:func:`bases`): one object serves either Trainer.

The primary namespace is ``pytorch_lightning`` where it is installed, else ``lightning.pytorch``: a
rule that does not depend on import order, so the driver and every worker agree on it.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import sys
import warnings
from abc import ABCMeta
from dataclasses import dataclass
from typing import Any

INSTALL_HINT = (
    "ray_lightning needs PyTorch Lightning: `pip install lightning` (import lightning.pytorch) or "
    "`pip install pytorch-lightning` (import pytorch_lightning); versions 2.4 to 2.6 are supported."
)


@dataclass(frozen=True)
class Namespace:
    """One installed Lightning: where its Trainer and its Fabric live."""

    trainer_package: str  # "pytorch_lightning" or "lightning.pytorch"
    fabric_package: str  # "lightning_fabric" or "lightning.fabric"
    distribution: str  # what pip installs: "pytorch-lightning" or "lightning"
    key: str  # a Python identifier naming it: "pytorch_lightning" or "lightning"

    def pl(self, path: str) -> Any:
        """A name of the trainer package: ``ns.pl("strategies.DDPStrategy")``."""
        return _lookup(self.trainer_package, path)

    def fabric(self, path: str) -> Any:
        """A name of the fabric package: ``ns.fabric("utilities.seed.reset_seed")``."""
        return _lookup(self.fabric_package, path)

    @property
    def version(self) -> str:
        return importlib.import_module(self.trainer_package).__version__

    def __str__(self) -> str:
        return self.trainer_package


# The oldest releases ray_lightning works with (the README's table tests them).
MINIMUM_LIGHTNING = (2, 4)
MINIMUM_RAY = (2, 50)
MINIMUM_TORCH = (2, 13)

PYTORCH_LIGHTNING = Namespace("pytorch_lightning", "lightning_fabric", "pytorch-lightning", "pytorch_lightning")
LIGHTNING = Namespace("lightning.pytorch", "lightning.fabric", "lightning", "lightning")
KNOWN = (PYTORCH_LIGHTNING, LIGHTNING)


@functools.cache
def _lookup(package: str, path: str) -> Any:
    module, _, name = f"{package}.{path}".rpartition(".")
    return getattr(importlib.import_module(module), name)


def _importable(ns: Namespace) -> bool:
    try:
        importlib.import_module(ns.trainer_package)
    except ImportError:
        return False
    return True


def version_tuple(version: str) -> tuple[int, ...]:
    """``"2.6.6"``, ``"2.13.0+cpu"``, ``"2.5.1.post0"`` -> ``(2, 6, 6)``, ``(2, 13, 0)``, ``(2, 5, 1)``."""
    parts = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        parts.append(int(digits or 0))
    return tuple(parts)


def _too_old(name: str, version: str, minimum: tuple[int, ...]) -> str | None:
    if version_tuple(version) >= minimum:
        return None
    return f"{name} {version} (ray_lightning needs {'.'.join(map(str, minimum))} or newer)"


@functools.cache
def installed() -> tuple[Namespace, ...]:
    """The Lightning namespaces importable here and recent enough, primary first.

    Raises ImportError naming what to install if there is none. A namespace older than
    :data:`MINIMUM_LIGHTNING` beside a recent one is left out with a warning: its Trainers refuse
    ray_lightning's classes.
    """
    found = tuple(ns for ns in KNOWN if _importable(ns))
    old = {ns: _too_old(ns.trainer_package, ns.version, MINIMUM_LIGHTNING) for ns in found}
    usable = tuple(ns for ns in found if old[ns] is None)
    if not usable:
        detail = "; found " + ", ".join(str(o) for o in old.values()) if found else ""
        raise ImportError(INSTALL_HINT + detail)
    for reason in filter(None, old.values()):
        warnings.warn(f"ray_lightning ignores {reason}; its Trainers cannot use ray_lightning.", stacklevel=2)
    return usable


def check_stack() -> None:
    """Refuse, at import, a Ray or torch older than the supported window, naming the version needed."""
    import ray
    import torch

    for name, version, minimum, pip in (
        ("Ray", ray.__version__, MINIMUM_RAY, "ray[default,tune]"),
        ("torch", torch.__version__, MINIMUM_TORCH, "torch"),
    ):
        reason = _too_old(name, version, minimum)
        if reason:
            raise ImportError(f"{reason}: pip install '{pip}>={'.'.join(map(str, minimum))}'")


def primary() -> Namespace:
    """The namespace of the public classes (``ray_lightning.RayStrategy``...): see the module docstring."""
    return installed()[0]


def of(obj: Any) -> Namespace:
    """The namespace ``obj`` (a Lightning object or class) belongs to; the primary one if neither."""
    cls = obj if isinstance(obj, type) else type(obj)
    for klass in cls.__mro__:
        module = klass.__module__ or ""
        for ns in KNOWN:
            if module == ns.trainer_package or module.startswith((ns.trainer_package + ".", ns.fabric_package + ".")):
                return ns
    return primary()


def every(path: str, *, fabric: bool = False) -> tuple[Any, ...]:
    """``path``'s object in every installed namespace (a tuple of classes serves ``isinstance``)."""
    return tuple(dict.fromkeys(ns.fabric(path) if fabric else ns.pl(path) for ns in installed()))


def bases(path: str) -> tuple[type, ...]:
    """The base classes of a class that must be a ``path`` of every installed namespace (callbacks)."""
    return every(path)


def set_everywhere(path: str, attribute: str, value: Any, *, fabric: bool = False) -> None:
    """Set ``attribute`` of ``path``'s object in every installed namespace (``rank_zero_only.rank``)."""
    for target in every(path, fabric=fabric):
        setattr(target, attribute, value)


class FamilyMeta(ABCMeta):
    """The metaclass of family members: each counts every member as itself for isinstance/issubclass."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return cls.__subclasscheck__(type(instance))

    def __subclasscheck__(cls, subclass: type) -> bool:
        # A member stands for its body: every namespace's member, and the subclasses of any.
        body = cls.__dict__.get("family_body")
        if body is not None and isinstance(subclass, type) and issubclass(subclass, body):
            return True
        return super().__subclasscheck__(subclass)


def family(body: type, base: str, module: str, *, fabric: bool = False) -> type:
    """Make ``body`` a subclass of ``base`` in every installed namespace; return the primary namespace's member.

    ``body`` is written once, without a Lightning base; its methods reach their namespace's names
    through ``self.namespace``. Each member is ``module``'s attribute ``<name>__<key>``; the primary
    one is also returned for the public name (its ``__qualname__`` is the plain name).
    :func:`sibling` gives a member's counterpart in another namespace, and :func:`rebuild_for` an
    equal object of it (where the body keeps ``init_arguments``).
    """
    name = body.__name__.lstrip("_")
    globals_ = sys.modules[module].__dict__
    members: dict[Namespace, type] = {}
    for ns in installed():
        lightning_base = ns.fabric(base) if fabric else ns.pl(base)
        attribute = name if ns == primary() else f"{name}__{ns.key}"
        namespace_dict = {
            "__module__": module,
            "__qualname__": attribute,
            "__doc__": body.__doc__,
            "namespace": ns,
            "family_members": members,
            "family_body": body,
        }
        member = FamilyMeta(name, (body, lightning_base), namespace_dict)
        members[ns] = member
        globals_[f"{name}__{ns.key}"] = member
    return members[primary()]


def sibling(obj_or_cls: Any, ns: Namespace) -> type:
    """The member of ``obj_or_cls``'s family in namespace ``ns``."""
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    members = cls.__dict__.get("family_members")
    if members is None:
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} subclasses {of(cls)}'s classes, so a {ns} Trainer cannot use it. "
            f"Subclass ray_lightning's class for {ns} instead ({_member_path(cls, ns)}), or use a {of(cls)} Trainer."
        )
    if ns not in members:
        raise TypeError(f"{cls.__name__} has no {ns} counterpart: {ns.distribution} is not installed.")
    return members[ns]


def _member_path(cls: type, ns: Namespace) -> str:
    for klass in cls.__mro__:
        members = klass.__dict__.get("family_members")
        if members and ns in members:
            return f"{members[ns].__module__}.{members[ns].__qualname__}"
    return "?"


def rebuild_for(obj: Any, ns: Namespace) -> Any:
    """``obj`` as an object of its sibling in ``ns``, built from its constructor's arguments (``init_arguments``),
    sharing the attributes ``obj.shared_with_rebuild`` names."""
    if getattr(type(obj), "namespace", None) == ns:
        return obj
    rebuilt = sibling(obj, ns)(**obj.init_arguments)
    # What the original and its rebuild both show (a record the rebuild appends to, which the caller reads).
    for name in getattr(obj, "shared_with_rebuild", ()):
        setattr(rebuilt, name, getattr(obj, name))
    return rebuilt


def register(member: type, registry: str, name: str, description: str) -> None:
    """Register each member of ``member``'s family as ``name`` in its own namespace's ``registry``."""
    for ns, cls in member.family_members.items():
        table = ns.pl(registry)
        if name not in table:
            table.register(name, cls, description=description)


# Lightning's TrainerFn values: its enum compares equal to them in either namespace
# (`trainer.state.fn == FITTING`), so no namespace's enum is needed.
FITTING, PREDICTING = "fit", "predict"


def to_cpu(data: Any) -> Any:
    """``data`` (tensors in any collection) moved to the CPU, by Lightning's own walker."""
    return primary().fabric("utilities.apply_func.move_data_to_device")(data, "cpu")


# Importing ray_lightning with neither Lightning installed, or a Ray or torch too old, says what to install.
check_stack()
installed()
