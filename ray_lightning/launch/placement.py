"""Where the workers go: whether the cluster can ever hold them, and the placement group they run in.

Each way of placing workers is a class with ``reserve``/``release`` (as horovod.ray's placement
strategies are): :class:`OwnPlacement` reserves a placement group of its own (a bundle per
worker, or per host with ``num_hosts``), waiting at most ``placement_timeout_s``;
:class:`TrialPlacement` uses the bundles of the placement group the caller already runs in (a
Ray Tune trial's, made by :func:`trial_bundles`), whose bundle 0 is the trial's own process.
"""

from __future__ import annotations

import contextlib
import difflib
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from ray_lightning.config import WorkerResources, describe_totals, fmt_amount, fmt_resource
from ray_lightning.errors import ClusterResourceError

# A Tune trial's placement group: bundle 0 holds the trial's own process, which only waits for its
# workers and reports; the workers take the bundles after it.
TRIAL_BUNDLE_INDEX = 0
TRIAL_BUNDLE = {"CPU": 1.0}


def trial_bundles(request: WorkerResources) -> list[dict[str, float]]:
    """The bundles a Tune trial that trains on ``request``'s workers reserves, bundle 0 its own."""
    return [dict(TRIAL_BUNDLE)] + [request.bundle() for _ in range(request.num_workers)]


def alive_node_resources() -> list[dict[str, float]]:
    """The total resources of each node of the cluster that is alive now."""
    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]


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
    _check_kinds(bundle, totals)
    # Memory is shown (in GiB...) when the request asks for it: it may be what blocks it.
    asks_memory = "memory" in bundle

    def describe(resources: dict[str, float]) -> str:
        return describe_totals(resources, memory=asks_memory)

    if not any(all(node.get(k, 0) >= v for k, v in bundle.items()) for node in nodes):
        raise ClusterResourceError(
            f"No single node can hold one worker {describe(bundle)}; "
            f"the nodes have: {'; '.join(describe(n) for n in nodes)}. "
            "Ask for fewer resources per worker."
        )
    if request.num_hosts:
        per_host = {k: v * request.workers_per_host for k, v in bundle.items()}
        fitting = sum(all(node.get(k, 0) >= v for k, v in per_host.items()) for node in nodes)
        if fitting < request.num_hosts:
            raise ClusterResourceError(
                f"Asked for {request.describe()}: {request.num_hosts} different nodes that each hold "
                f"{describe(per_host)}, but only {fitting} of the cluster's {len(nodes)} node(s) can "
                f"(the nodes have: {'; '.join(describe(n) for n in nodes)}). "
                "Use fewer hosts or slots, or num_workers to let Ray pack the workers."
            )
    for name, amount in bundle.items():
        if amount * request.num_workers > totals.get(name, 0) + 1e-9:
            raise ClusterResourceError(
                f"Asked for {request.describe()} = {fmt_resource(name, amount * request.num_workers)} {name} in all, "
                f"but the whole Ray cluster has {fmt_resource(name, totals.get(name, 0))} {name} "
                f"({describe(totals)}). Use fewer workers or fewer resources per worker."
            )


def _check_kinds(bundle: dict[str, float], totals: dict[str, float]) -> None:
    """Every resource the request names exists somewhere in the cluster (GPUs, custom resources)."""
    for name, amount in bundle.items():
        if name == "GPU" and totals.get("GPU", 0) == 0:
            raise ClusterResourceError(
                f"Asked for {fmt_amount(amount)} GPU per worker (use_gpu=True or resources_per_worker['GPU']), "
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


@dataclass
class Placement:
    """The placement group a launch's workers run in: worker ``i`` draws from bundle ``bundles[i]`` on ``nodes[i]``."""

    pg: Any
    bundles: list[int]
    nodes: list[str]
    owned: bool = field(default=True)

    def release(self) -> None:
        """Give the reservation back, if it is this launch's own."""
        if self.owned:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)


class OwnPlacement(Placement):
    """A placement group of the launch's own, removed when its workers stop."""

    @classmethod
    def reserve(cls, request: WorkerResources, timeout_s: float) -> OwnPlacement:
        """Reserve ``request`` as one placement group; fail after ``timeout_s`` saying what the cluster has free."""
        bundles, strategy = request.placement()
        pg = placement_group(bundles, strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except GetTimeoutError:
            remove_placement_group(pg)
            memory = "memory" in request.bundle()
            raise ClusterResourceError(
                f"Could not reserve {request.describe()} within {timeout_s:g} s "
                f"(placement_timeout_s). The cluster has {describe_totals(ray.cluster_resources(), memory)}, "
                f"of which {describe_totals(ray.available_resources(), memory)} are free now; other jobs or "
                "trials may hold the rest. Use fewer workers, wait for them to finish, or raise "
                "placement_timeout_s."
            ) from None
        except BaseException:
            remove_placement_group(pg)
            raise
        bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
        indices = [request.bundle_index(i) for i in range(request.num_workers)]
        return cls(pg, indices, [bundle_nodes[b] for b in indices], owned=True)


class TrialPlacement(Placement):
    """Bundles of a placement group the caller already runs in (a Tune trial's); left in place afterwards."""

    @classmethod
    def within(cls, pg: Any, request: WorkerResources) -> TrialPlacement:
        """The first bundles after the trial's own that can each hold one worker."""
        if request.num_hosts:
            raise ClusterResourceError(
                "num_hosts/num_slots cannot be used inside a placement group (e.g. a Ray Tune trial), whose "
                "bundles are already placed; use num_workers."
            )
        need = request.bundle()
        specs = pg.bundle_specs
        fitting = [
            i
            for i, spec in enumerate(specs)
            if i != TRIAL_BUNDLE_INDEX and all(spec.get(k, 0) >= v for k, v in need.items())
        ]
        if len(fitting) < request.num_workers:
            reserved = ", ".join(describe_totals(spec) for spec in specs)
            raise ClusterResourceError(
                f"This fit runs inside a placement group (a Ray Tune trial's) that reserved [{reserved}]: "
                f"bundle {TRIAL_BUNDLE_INDEX} for the trial itself and {len(fitting)} that can each hold a worker, "
                f"but it needs {request.describe()}. Reserve them with "
                "resources_per_trial=ray_lightning.tune.get_tune_resources("
                "num_workers=..., num_cpus_per_worker=..., use_gpu=..., resources_per_worker=...) "
                "(or tune.with_resources(train_fn, get_tune_resources(...)))."
            )
        indices = fitting[: request.num_workers]
        bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
        return cls(pg, indices, [bundle_nodes[b] for b in indices], owned=False)
