"""What each worker asks Ray for, checked before anything is launched.

Two checks live here: :func:`resolve_worker_resources` validates the arguments a user passes
(no Ray needed), and :func:`check_cluster_can_hold` compares the request with the cluster Ray is
connected to, so that an impossible request fails at once instead of waiting forever.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Names users write for Ray's built-in resources; Ray only understands the canonical spelling.
_CANONICAL = {
    "cpu": "CPU",
    "cpus": "CPU",
    "num_cpus": "CPU",
    "gpu": "GPU",
    "gpus": "GPU",
    "num_gpus": "GPU",
}
_BUILTIN = ("CPU", "GPU", "memory")


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
    def workers_per_host(self) -> int:
        return self.num_workers // self.num_hosts if self.num_hosts else 1

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
        parts = [f"{_fmt(v)} {k}" for k, v in self.bundle().items()]
        each = f"{{{', '.join(parts) or 'nothing'}}}"
        if self.num_hosts:
            return f"{self.num_hosts} host(s) x {self.workers_per_host} worker(s) x {each}"
        return f"{self.num_workers} worker(s) x {each}"


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


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


class ClusterResourceError(RuntimeError):
    """The cluster cannot hold the requested workers; the message says what was asked and what exists."""


def check_cluster_can_hold(request: WorkerResources, nodes: list[dict[str, float]]) -> None:
    """Fail at once when no waiting could ever place ``request`` on the alive ``nodes``.

    ``nodes`` holds each alive node's total resources (``ray.nodes()[i]["Resources"]``).
    A request that only lacks *free* resources is left to the bounded placement wait.
    """
    totals: dict[str, float] = {}
    for node in nodes:
        for name, amount in node.items():
            totals[name] = totals.get(name, 0.0) + amount
    bundle = request.bundle()

    for name, amount in bundle.items():
        if name == "GPU" and totals.get("GPU", 0) == 0:
            raise ClusterResourceError(
                f"Asked for {_fmt(amount)} GPU per worker (use_gpu=True or resources_per_worker['GPU']), "
                f"but the Ray cluster has no GPUs ({describe_totals(totals)}). "
                "Set use_gpu=False to train on CPUs, or connect to a cluster with GPU nodes."
            )
        if name not in totals:
            known = sorted(k for k in totals if not k.startswith("node:") and "_group_" not in k)
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ClusterResourceError(
                f"resources_per_worker asks for {name!r}, which no node in the Ray cluster has.{hint} "
                f"The cluster has: {', '.join(known)}."
            )

    if not any(all(node.get(k, 0) >= v for k, v in bundle.items()) for node in nodes):
        raise ClusterResourceError(
            f"No single node can hold one worker {describe_totals(bundle)}; "
            f"the nodes have: {'; '.join(describe_totals(n) for n in nodes)}. "
            "Ask for fewer resources per worker."
        )
    if request.num_hosts:
        per_host = {k: v * request.workers_per_host for k, v in bundle.items()}
        fitting = sum(all(node.get(k, 0) >= v for k, v in per_host.items()) for node in nodes)
        if fitting < request.num_hosts:
            raise ClusterResourceError(
                f"Asked for {request.describe()}: {request.num_hosts} different nodes that each hold "
                f"{describe_totals(per_host)}, but only {fitting} of the cluster's {len(nodes)} node(s) can "
                f"(the nodes have: {'; '.join(describe_totals(n) for n in nodes)}). "
                "Use fewer hosts or slots, or num_workers to let Ray pack the workers."
            )
    for name, amount in bundle.items():
        if amount * request.num_workers > totals.get(name, 0) + 1e-9:
            raise ClusterResourceError(
                f"Asked for {request.describe()} = {_fmt(amount * request.num_workers)} {name} in all, "
                f"but the whole Ray cluster has {_fmt(totals.get(name, 0))} {name} "
                f"({describe_totals(totals)}). Use fewer workers or fewer resources per worker."
            )


def describe_totals(resources: Mapping[str, float]) -> str:
    shown = {
        k: v
        for k, v in resources.items()
        if k in _BUILTIN[:2] or (not k.startswith("node:") and k not in ("memory", "object_store_memory"))
    }
    shown = {k: v for k, v in shown.items() if "_group_" not in k}
    return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in sorted(shown.items())) + "}"
