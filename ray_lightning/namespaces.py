"""The two Lightnings: ``pytorch_lightning`` and ``lightning.pytorch``, and ray_lightning written once for both.

Lightning ships the same code as two distributions: ``pytorch-lightning`` (modules
``pytorch_lightning`` and ``lightning_fabric``) and ``lightning`` (``lightning.pytorch`` and
``lightning.fabric``). Their classes are distinct: a ``lightning.pytorch.Trainer`` refuses a strategy
that subclasses ``pytorch_lightning``'s ``Strategy``, and Lightning's ``is_overridden`` refuses a
``pytorch_lightning`` callback. :class:`Namespace` finds a Lightning name in one of the two
(``ns.pl("callbacks.ModelCheckpoint")``); :func:`installed` lists those importable here; :func:`of`
tells which one an object belongs to; :func:`every` gives a name from all of them, for ``isinstance``.

How one class serves both packages. There are three ways, one per kind of class:

1. **Strategies, accelerators, the cluster environment** subclass :class:`PerNamespace` and name
   their Lightning base (``lightning_base = "strategies.DDPStrategy"``), without subclassing it. The
   class users import (``ray_lightning.RayStrategy``) is that namespace-free class: they instantiate
   it, subclass it and test ``isinstance`` against it. What Lightning gets is an instance of its
   *member* for one namespace, ``member(RayStrategy, ns)``: a subclass of both the public class and
   ``ns``'s Lightning base, made on first use and cached. ``RayStrategy(...)`` builds the member of
   the :func:`primary` namespace. So that class checks (jsonargparse, LightningCLI) accept the public
   class for either package, it is registered as a virtual subclass of each package's Lightning
   base (``ABCMeta.register``). Instances pickle as their public class and namespace, so a worker
   gets the same member class as any other object of its process.
2. **A Trainer of the other package** swaps such an object for its member of the Trainer's namespace,
   built again from the same constructor arguments (:func:`rebuild_for`, called by
   :mod:`ray_lightning._lightning.connector`).
3. **Callbacks** pass through no hook of ours, so they subclass every installed namespace's
   ``Callback`` at once (``class C(*namespaces.every("callbacks.Callback"))``): one object serves
   either Trainer.

The primary namespace is ``pytorch_lightning`` where it is installed, else ``lightning.pytorch``: a
rule that does not depend on import order, so the driver and every worker agree on it.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import time
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

# ray_lightning/__init__.py imports this module first: when the process began to import the package, and with it
# torch and Lightning (a worker's start-up breakdown, ray_lightning.channel.timings).
IMPORT_STARTED = time.time()

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


# The oldest releases ray_lightning works with (docs/versions.md's table tests them).
MINIMUM_LIGHTNING = (2, 4)
MINIMUM_RAY = (2, 50)
MINIMUM_TORCH = (2, 4)
# What needs a newer torch than the package does is refused when it is made (require_torch), not at import:
# FSDP2's public ``torch.distributed.fsdp.fully_shard`` and ``torch.distributed.tensor`` (DTensor) are torch
# 2.6's. Over gloo (CPUs, workers sharing a GPU) FSDP2 needs 2.9: 2.6's first all-gather fails on CPUs
# ("'Stream' object has no attribute 'record_event'"), and 2.7 and 2.8 sum the ranks' gradients instead of
# averaging them (2 CPU ranks: weights 2.8x as far from where they started as DDP's, in the matrix's corners).
SHARDING_TORCH = (2, 6)
GLOO_SHARDING_TORCH = (2, 9)

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


def require_torch(minimum: tuple[int, ...], owner: str, needs: str) -> None:
    """Refuse ``owner`` (a strategy being made) on a torch older than ``minimum``; ``needs`` says what for.

    Example: ``require_torch(SHARDING_TORCH, "RayFSDPStrategy", "FSDP2's public fully_shard")``.
    """
    import torch

    if version_tuple(torch.__version__) < minimum:
        version = ".".join(map(str, minimum))
        raise ImportError(
            f"{owner} needs torch {version} or newer ({needs}); this is torch {torch.__version__}. "
            f"pip install 'torch>={version}' (ray_lightning's other strategies work from torch "
            f"{'.'.join(map(str, MINIMUM_TORCH))})."
        )


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


def set_everywhere(path: str, attribute: str, value: Any, *, fabric: bool = False) -> None:
    """Set ``attribute`` of ``path``'s object in every installed namespace (``rank_zero_only.rank``)."""
    for target in every(path, fabric=fabric):
        setattr(target, attribute, value)


class PerNamespace:
    """A ray_lightning class Lightning sees, written once for both packages (see the module docstring, way 1).

    Subclasses set ``lightning_base`` (a path in the trainer package, or with ``lightning_fabric`` in
    the fabric package). ``namespace`` is None on the public class and the namespace on a member;
    ``public`` is the public class (on a member: the class it was made from).
    """

    lightning_base: ClassVar[str]
    lightning_fabric: ClassVar[bool] = False
    namespace: ClassVar[Namespace | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Class checks (LightningCLI's) accept the public class, and a user's subclass of it, for either package.
        super().__init_subclass__(**kwargs)
        if cls.namespace is None and getattr(cls, "lightning_base", None) is not None:
            for ns in installed():
                _lightning_base(cls, ns).register(cls)

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls.namespace is None:
            cls = member(cls, primary())
        return super().__new__(cls)

    def __reduce_ex__(self, protocol: Any) -> tuple:
        # A member is made per process: pickled by reference to the public class it was made from.
        return _new_member, (type(self).public, type(self).namespace), self.__getstate__()


def _lightning_base(cls: type, ns: Namespace) -> type:
    return ns.fabric(cls.lightning_base) if cls.lightning_fabric else ns.pl(cls.lightning_base)


def _new_member(public: type, ns: Namespace) -> Any:
    return object.__new__(member(public, ns))


_members: dict[tuple[type, Namespace], type] = {}


def member(cls: type, ns: Namespace) -> type:
    """``cls`` (a :class:`PerNamespace` subclass, or a member of it) as a subclass of ``ns``'s Lightning base."""
    if cls.namespace == ns:
        return cls
    public = cls.public if cls.namespace is not None else cls
    made = _members.get((public, ns))
    if made is None:
        if ns not in installed():
            raise TypeError(f"{public.__name__} has no {ns} counterpart: {ns.distribution} is not installed.")
        base = _lightning_base(public, ns)
        attributes = {"__module__": public.__module__, "__qualname__": public.__qualname__, "__doc__": public.__doc__}
        made = type(public.__name__, (public, base), {**attributes, "namespace": ns, "public": public})
        _members[(public, ns)] = made
    return made


def rebuild_for(obj: Any, ns: Namespace) -> Any:
    """``obj`` as an object of its member for ``ns``, built from its constructor's arguments (``init_arguments``),
    sharing the attributes ``obj.shared_with_rebuild`` names."""
    if type(obj).namespace == ns:
        return obj
    rebuilt = member(type(obj), ns)(**obj.init_arguments)
    # What the original and its rebuild both show (a record the rebuild appends to, which the caller reads).
    for name in getattr(obj, "shared_with_rebuild", ()):
        setattr(rebuilt, name, getattr(obj, name))
    return rebuilt


def register(cls: type, registry: str, name: str, description: str) -> None:
    """Register ``cls``'s member of each namespace as ``name`` in that namespace's ``registry``."""
    for ns in installed():
        table = ns.pl(registry)
        if name not in table:
            table.register(name, member(cls, ns), description=description)


# Lightning's TrainerFn values: its enum compares equal to them in either namespace
# (`trainer.state.fn == FITTING`), so no namespace's enum is needed.
FITTING, PREDICTING = "fit", "predict"


def to_cpu(data: Any) -> Any:
    """``data`` (tensors in any collection) moved to the CPU, by Lightning's own walker."""
    return primary().fabric("utilities.apply_func.move_data_to_device")(data, "cpu")


# Importing ray_lightning with neither Lightning installed, or a Ray or torch too old, says what to install.
check_stack()
installed()
