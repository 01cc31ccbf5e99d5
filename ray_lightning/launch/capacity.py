"""Whether the cluster can ever hold a request: its alive nodes, and the nodes its autoscaler could add.

Each decision reads the cluster once (:class:`ClusterNow`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import ray

from ray_lightning.config.display import describe_totals, fmt_amount, fmt_resource
from ray_lightning.config.resources import WorkerResources
from ray_lightning.errors import ClusterResourceError
from ray_lightning.launch.autoscaler import Autoscaler, NodeType, added_capacity, bundles_per_node, fmt_count


@dataclass(frozen=True)
class ClusterNow:
    """The cluster's alive nodes at one moment: node id -> total resources."""

    nodes: Mapping[str, Mapping[str, float]]

    @classmethod
    def read(cls) -> ClusterNow:
        return cls({n["NodeID"]: n["Resources"] for n in ray.nodes() if n.get("Alive")})

    @property
    def resources(self) -> list[dict[str, float]]:
        """Each alive node's total resources."""
        return [dict(r) for r in self.nodes.values()]


def check_cluster_can_hold(
    request: WorkerResources, nodes: list[dict[str, float]], autoscaler: Autoscaler | None = None
) -> None:
    """Fail at once when no waiting could ever place ``request`` on the alive ``nodes``.

    ``nodes`` holds each alive node's total resources (``ray.nodes()[i]["Resources"]``). With an
    ``autoscaler``, what its node types could add counts too (unknown node types: nothing fails).
    A request that only lacks *free* resources is left to the bounded placement wait.
    """
    try:
        _check_alive_nodes(request, nodes)
    except ClusterResourceError:
        if autoscaler is None:
            raise
        if autoscaler.node_types is not None:
            _check_with_node_types(request, nodes, autoscaler)


def _check_alive_nodes(request: WorkerResources, nodes: list[dict[str, float]]) -> None:
    """What a cluster without an autoscaler checks; each error names the request and the alive nodes."""
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


def _check_with_node_types(request: WorkerResources, nodes: list[dict[str, float]], autoscaler: Autoscaler) -> None:
    """Fail when neither the alive nodes nor those the autoscaler may still add can hold ``request``."""
    assert autoscaler.node_types is not None
    bundles, strategy = request.placement()
    bundle, spread = bundles[0], strategy == "STRICT_SPREAD"
    on_alive = sum(min(n, 1) if spread else n for n in (bundles_per_node(bundle, node) for node in nodes))
    added = added_capacity(bundle, autoscaler.node_types, autoscaler.max_workers, autoscaler.running, spread)
    if on_alive + added >= len(bundles):
        return
    memory = "memory" in bundle
    where = (
        f"Alive nodes: {'; '.join(describe_totals(n, memory) for n in nodes) or 'none'}. "
        f"Node types the autoscaler can launch: {autoscaler.describe_types()}."
    )
    if not on_alive and not any(bundles_per_node(bundle, t.resources, node_type=True) for t in autoscaler.node_types):
        what = f"one host's {request.workers_per_host} worker(s)" if spread else "one worker"
        raise ClusterResourceError(
            f"Neither a node of the Ray cluster nor a node type its autoscaler can launch can hold {what} "
            f"{describe_totals(bundle, memory)}.{_missing_hint(bundle, nodes, autoscaler.node_types)} {where} "
            "Ask for fewer resources per worker, or add a node type that has them to the cluster's config "
            "(available_node_types)."
        )
    unit = "host(s)" if spread else "worker(s)"
    raise ClusterResourceError(
        f"Asked for {request.describe()}, but at most {fmt_count(on_alive + added)} of the {len(bundles)} {unit} "
        f"fit: {on_alive} on the alive nodes and {fmt_count(added)} on the nodes the autoscaler may still add. "
        f"{where} Use fewer workers, or raise max_workers in the cluster's config."
    )


def _missing_hint(bundle: dict[str, float], nodes: list[dict[str, float]], node_types: Sequence[NodeType]) -> str:
    """What the request names that no node and no node type has, with the closest name they do have."""
    known = {k for r in [*nodes, *(t.resources for t in node_types)] for k in r}
    known = {k for k in known if not k.startswith("node:") and "_group_" not in k}
    hints = []
    for name in sorted(set(bundle) - known):
        if name == "GPU":
            hints.append(" No node and no node type has GPUs: set use_gpu=False to train on CPUs.")
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        hints.append(f" No node and no node type has {name!r}." + (f" Did you mean {close[0]!r}?" if close else ""))
    return "".join(hints)
