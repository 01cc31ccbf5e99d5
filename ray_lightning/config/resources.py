"""What each worker reserves and how many workers there are; the placement group's bundles."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ray_lightning.config.display import fmt_resource

# Names users write for Ray's built-in resources; Ray only understands the canonical spelling.
_CANONICAL = {
    "cpu": "CPU",
    "cpus": "CPU",
    "num_cpus": "CPU",
    "gpu": "GPU",
    "gpus": "GPU",
    "num_gpus": "GPU",
}


@dataclass(frozen=True)
class WorkerResources:
    """The resources one worker actor reserves, and how many workers there are.

    ``gpus`` follows what is actually reserved: a worker trains on CUDA exactly when ``gpus > 0``.
    With ``num_hosts`` set, the workers are ``num_hosts`` groups of ``num_workers // num_hosts``,
    each group on its own node; otherwise Ray packs them onto as few nodes as it can.
    """

    num_workers: int
    cpus: float
    gpus: float
    custom: Mapping[str, float] = field(default_factory=dict)
    num_hosts: int | None = None

    @property
    def use_gpu(self) -> bool:
        return self.gpus > 0

    @property
    def may_share_gpu(self) -> bool:
        """Whether Ray may give two of these workers one GPU: there are several, each reserving a fraction of one."""
        return 0 < self.gpus < 1 and self.num_workers > 1

    @property
    def workers_per_host(self) -> int:
        return self.num_workers // self.num_hosts if self.num_hosts else 1

    def with_workers(self, num_workers: int) -> WorkerResources:
        """The same workers, ``num_workers`` of them (an elastic fit's size now)."""
        return replace(self, num_workers=num_workers)

    def placement(self) -> tuple[list[dict[str, float]], str]:
        """The placement group's bundles and strategy.

        Without hosts: one bundle per worker, packed. With hosts: one bundle per host holding all
        of that host's workers, each on a different node (``STRICT_SPREAD``).
        """
        if not self.num_hosts:
            return [self.bundle() for _ in range(self.num_workers)], "PACK"
        per_host = {k: v * self.workers_per_host for k, v in self.bundle().items()}
        return [dict(per_host) for _ in range(self.num_hosts)], "STRICT_SPREAD"

    def bundle_index(self, worker: int) -> int:
        """The bundle worker number ``worker`` draws its resources from."""
        return worker // self.workers_per_host if self.num_hosts else worker

    def bundle(self) -> dict[str, float]:
        """One placement-group bundle: exactly what one worker actor asks for."""
        bundle: dict[str, float] = {"CPU": self.cpus}
        if self.gpus:
            bundle["GPU"] = self.gpus
        bundle.update(self.custom)
        return {k: v for k, v in bundle.items() if v > 0}

    def actor_options(self) -> dict[str, Any]:
        """Keyword arguments for ``ActorClass.options`` that ask for the same as :meth:`bundle`."""
        options: dict[str, Any] = {"num_cpus": self.cpus, "num_gpus": self.gpus}
        custom = {k: v for k, v in self.custom.items() if k != "memory"}
        if custom:
            options["resources"] = custom
        if self.custom.get("memory"):
            options["memory"] = self.custom["memory"]
        return options

    def describe(self) -> str:
        parts = [f"{fmt_resource(k, v)} {k}" for k, v in self.bundle().items()]
        each = f"{{{', '.join(parts) or 'nothing'}}}"
        if self.num_hosts:
            return f"{self.num_hosts} host(s) x {self.workers_per_host} worker(s) x {each}"
        return f"{self.num_workers} worker(s) x {each}"


def _check_amount(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a non-negative number, got {value!r}.")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}.")
    return float(value)


def resolve_worker_resources(
    num_workers: Any,
    num_cpus_per_worker: Any = 1,
    use_gpu: Any = False,
    resources_per_worker: Mapping[str, Any] | None = None,
    num_hosts: int | None = None,
) -> WorkerResources:
    """Validate the user's arguments and merge them into one :class:`WorkerResources`.

    ``resources_per_worker`` wins over the plain arguments: its ``CPU`` replaces
    ``num_cpus_per_worker`` and its ``GPU`` replaces ``use_gpu`` (``GPU: 0`` means CPU training even
    with ``use_gpu=True``; ``GPU: 0.5`` means CUDA training even with ``use_gpu=False``).
    ``num_hosts`` (validated by the caller) must divide ``num_workers``.
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, numbers.Integral):
        raise TypeError(f"num_workers must be an int >= 1, got {num_workers!r}.")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers!r}.")
    if num_hosts is not None and num_workers % num_hosts:
        raise ValueError(f"num_workers={num_workers} cannot be split evenly over num_hosts={num_hosts}.")
    cpus = _check_amount("num_cpus_per_worker", num_cpus_per_worker)
    if not isinstance(use_gpu, bool):
        raise TypeError(f"use_gpu must be True or False, got {use_gpu!r}.")
    gpus = 1.0 if use_gpu else 0.0

    custom: dict[str, float] = {}
    if resources_per_worker is not None:
        if not isinstance(resources_per_worker, Mapping):
            raise TypeError(
                "resources_per_worker must be a dict such as {'CPU': 2, 'GPU': 1, 'my_resource': 1}, "
                f"got {resources_per_worker!r}."
            )
        for name, amount in resources_per_worker.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"resources_per_worker keys must be resource names, got {name!r}.")
            canonical = _CANONICAL.get(name.lower())
            if canonical is not None and name != canonical:
                raise ValueError(
                    f"resources_per_worker has {name!r}; Ray calls this resource {canonical!r}. "
                    f"Write resources_per_worker={{{canonical!r}: {amount!r}}}."
                )
            value = _check_amount(f"resources_per_worker[{name!r}]", amount)
            if name == "CPU":
                cpus = value
            elif name == "GPU":
                gpus = value
            else:
                custom[name] = value
    if cpus == 0 and gpus == 0 and not any(custom.values()):
        raise ValueError(
            "Each worker must reserve some resource: num_cpus_per_worker=0 with no GPU or custom resource "
            "would let Ray start any number of workers on one CPU. Ask for a CPU, a GPU or a custom resource."
        )
    if gpus > 1 and not gpus.is_integer():
        raise ValueError(f"A worker can reserve a fraction of one GPU or whole GPUs, not {gpus:g}.")
    return WorkerResources(int(num_workers), cpus, gpus, custom, num_hosts)


def refuse_nccl_on_a_shared_gpu(owner: str, backend: Any, resources: WorkerResources) -> None:
    """Refuse ``process_group_backend`` asking NCCL where workers may share a GPU, before any worker starts.

    NCCL refuses two ranks on one device, and workers that each reserve a fraction of a GPU are put on the
    same one: without this, every rank would fail as the process group forms. ``owner``: the strategy's name.
    """
    if not isinstance(backend, str) or "nccl" not in backend.lower() or not resources.may_share_gpu:
        return
    raise ValueError(
        f"{owner}(process_group_backend={backend!r}) cannot work with {resources.describe()}: each worker reserves "
        f"{resources.gpus:g} of a GPU, so Ray puts several workers on one GPU, and NCCL refuses two ranks on one "
        "device. Leave process_group_backend out (workers that share a GPU then use gloo, which reduces CUDA "
        "tensors too), pass process_group_backend='gloo', or reserve a whole GPU per worker (use_gpu=True)."
    )
