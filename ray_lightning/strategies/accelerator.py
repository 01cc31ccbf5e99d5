"""The accelerator the Trainer sees when training runs on Ray workers, and the classic ``accelerator=`` form.

:class:`WorkerAccelerator` serves two purposes:

* ``Trainer(accelerator=RayAccelerator(num_workers=4, cpus_per_worker=1, use_gpu=False))``: the
  classic form. Lightning 2.x picks strategies apart from accelerators, so
  :mod:`ray_lightning._lightning.connector` turns such an accelerator into the strategy it names
  (``strategy_class``). Each strategy module defines its form beside it (``RayAccelerator`` in
  :mod:`.ddp`, ``RayFSDPAccelerator`` in :mod:`.fsdp`...), and :func:`register` puts both into
  Lightning's registries under the strategy's ``registry_name`` (``"ray"``, ``"fsdp_ray"``...).
* Inside each worker it does what Lightning's CPU or CUDA accelerator would do, following the
  device the worker really got: the driver may have no GPU while the workers do.
"""

from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from typing_extensions import override

from ray_lightning import _lightning, namespaces, runtime
from ray_lightning.config.arguments import check_keywords

if TYPE_CHECKING:
    import pytorch_lightning as pl


class WorkerAccelerator(namespaces.PerNamespace):
    """A Lightning ``Accelerator`` for Ray workers; the base of every ``accelerator=`` form.

    Args:
        num_workers: number of training processes (Ray actors), or ``(min, max)`` (elastic).
        cpus_per_worker: CPUs reserved for each worker.
        use_gpu: reserve one GPU per worker and train on CUDA.
        **strategy_kwargs: any other argument of the form's strategy (``resources_per_worker``,
            ``init_hook``, its Lightning strategy's arguments...).
    """

    lightning_base = "accelerators.Accelerator"
    # The strategy this form stands for (set by each form).
    strategy_class: ClassVar[type]
    # Strategy arguments this accelerator takes under another name.
    renamed = {"num_cpus_per_worker": "cpus_per_worker"}

    def __init__(
        self,
        num_workers: int | tuple[int, int] = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        **strategy_kwargs: Any,
    ) -> None:
        _lightning.ensure_installed(self.namespace)
        super().__init__()
        self.init_arguments = dict(num_workers=num_workers, cpus_per_worker=cpus_per_worker, use_gpu=use_gpu)
        self.init_arguments.update(strategy_kwargs)
        for theirs, ours in self.renamed.items():
            if theirs in strategy_kwargs:
                value = strategy_kwargs[theirs]
                raise TypeError(f"{type(self).__name__} calls {theirs} {ours}: write {ours}={value!r}.")
        self._strategy_kwargs = dict(
            num_workers=num_workers, num_cpus_per_worker=cpus_per_worker, use_gpu=use_gpu, **strategy_kwargs
        )
        self._strategy: Any = None
        # Validate now so bad arguments fail in Trainer(...), not in fit().
        self.make_strategy()

    def make_strategy(self) -> Any:
        """The strategy this accelerator stands for (built once)."""
        if self._strategy is None:
            cls = namespaces.member(self.strategy_class, self.namespace)
            accepted = getattr(cls, "accepted_keywords", None)
            if accepted is not None:
                own = set(inspect.signature(type(self).__init__).parameters) - {"self", "strategy_kwargs"}
                check_keywords(
                    type(self).__name__,
                    set(self._strategy_kwargs) - set(self.renamed),
                    (accepted() - set(self.renamed)) | own,
                    f"its own arguments and {cls.__name__}'s",
                )
            self._strategy = cls(**self._strategy_kwargs)
            self._strategy.accelerator = self
        return self._strategy

    @classmethod
    def for_strategy(cls, strategy: Any) -> Any:
        """The accelerator a strategy uses when the user did not pass one of these accelerators."""
        accelerator = cls.__new__(cls)
        cls.namespace.pl("accelerators.Accelerator").__init__(accelerator)
        accelerator.init_arguments = {}
        accelerator._strategy_kwargs = {}
        accelerator._strategy = strategy
        return accelerator

    def belongs_to(self, strategy: Any) -> bool:
        """Whether this accelerator describes ``strategy``'s workers (or none yet)."""
        return self._strategy is None or self._strategy is strategy

    # -- inside a worker: behave like Lightning's accelerator for the device the worker got --------

    def _delegate(self, device: torch.device | str | None) -> Any:
        device = torch.device(device) if device is not None else torch.device("cpu")
        return self._cuda() if device.type == "cuda" else self.namespace.pl("accelerators.CPUAccelerator")()

    def _cuda(self) -> Any:
        return self.namespace.pl("accelerators.CUDAAccelerator")()

    @override
    def setup_device(self, device: torch.device) -> None:
        if not runtime.in_worker():
            _lightning.raise_not_converted(self)
        if device.type == "cuda":
            self._cuda().setup_device(device)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            self._cuda().setup(trainer)

    @override
    def teardown(self) -> None:
        if runtime.in_worker() and torch.cuda.is_initialized():
            self._cuda().teardown()

    @override
    def get_device_stats(self, device: str | torch.device) -> dict[str, Any]:
        return self._delegate(device).get_device_stats(device)

    # -- on the driver: Lightning asks these while building the Trainer ----------------------------

    @staticmethod
    @override
    def parse_devices(devices: Any) -> Any:
        # The number of workers decides the devices; `Trainer(devices=...)` has no say. Lightning
        # turns the default "auto" into auto_device_count() (1) before asking, so 1 cannot warn.
        if devices not in (1, "1", "auto"):
            warnings.warn(
                f"devices={devices!r} (of the Trainer or Fabric) is ignored: ray_lightning trains one process per Ray "
                "worker, each on the device Ray reserves for it. Set how many with num_workers (RayStrategy, "
                "RayAccelerator, HorovodRayStrategy) or num_hosts x num_slots (Horovod), and GPUs with use_gpu or "
                "resources_per_worker.",
                stacklevel=2,
            )
        return devices

    @staticmethod
    @override
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        # A placeholder: each worker learns its real device at launch.
        return [torch.device("cpu")]

    @staticmethod
    @override
    def auto_device_count() -> int:
        return 1

    @staticmethod
    @override
    def is_available() -> bool:
        return True

    @classmethod
    @override
    def name(cls) -> str:
        return cls.strategy_class.registry_name

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: Any) -> None:
        # Lightning calls this on the classes it finds; register() did it for every namespace.
        if cls.name() not in accelerator_registry:
            accelerator_registry.register(cls.name(), cls, description=f"{cls.__name__} (ray_lightning)")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._strategy_kwargs.items() if v is not None)
        return f"{type(self).__name__}({args})"


def register(form: type, description: str) -> None:
    """Register an accelerator form and its strategy in Lightning's registries (every namespace), both under
    the strategy's ``registry_name``: ``Trainer(strategy="ray")``, ``Trainer(accelerator="ray")``."""
    name = form.strategy_class.registry_name
    namespaces.register(form.strategy_class, "strategies.StrategyRegistry", name, f"{description} (ray_lightning)")
    namespaces.register(form, "accelerators.AcceleratorRegistry", name, f"{form.__name__} (ray_lightning)")
