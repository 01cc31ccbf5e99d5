"""What the cluster's autoscaler can add, and what it says while a request waits for its nodes.

A request no alive node can hold may still be placed once the autoscaler starts nodes of a type
that can (a ``ray up`` cluster whose GPU workers have ``min_workers: 0``). :func:`find_autoscaler`
reads the node types through Ray's own state, first what an autoscaler v2 deployment (KubeRay)
stores in the GCS, else the autoscaling config the head's monitor process was started with
(autoscaler v1: ``ray up``, ``ray start --autoscaling-config``); :func:`read_report` reads what it
is launching and what failed. Ray has no public API for either (the private reads are in
:mod:`ray_lightning._ray`): every read is bounded and a failure means "unknown", never an error
of its own.

Decisions: what a node type could hold is decided by pure functions (:func:`bundles_per_node`,
:func:`added_capacity`) on plain dicts, so they are tested without Ray. Memory and object store
memory that a node type does not list do not limit it: configs rarely list them, Ray sizes them
from the machine.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from ray_lightning._ray import kv
from ray_lightning._ray import state as ray_state
from ray_lightning.config.display import describe_totals, fmt_amount

# How long reading what the autoscaler launches may take: a task on the head node, whose first
# worker process may need to start (10 s on a busy 2-core head).
READ_TIMEOUT_S = 30.0
_GCS_TIMEOUT_S = 5
HEAD_RESOURCE = "node:__internal_head__"
# Resources Ray sizes from the machine, which node types usually leave out.
_SIZED_BY_MACHINE = ("memory", "object_store_memory")
UNBOUNDED = sys.maxsize


@dataclass(frozen=True)
class NodeType:
    """A kind of node the autoscaler can start: its resources, and at most how many (None: no bound)."""

    name: str
    resources: Mapping[str, float]
    max_workers: int | None = None

    def describe(self) -> str:
        most = "no bound" if self.max_workers is None else f"up to {self.max_workers}"
        return f"{self.name} {describe_totals(self.resources)} ({most})"


@dataclass(frozen=True)
class Autoscaler:
    """The cluster's autoscaler: its version, the worker node types it launches (None: unreadable),
    the cluster-wide ``max_workers`` and how many worker nodes of each type are up now."""

    version: str
    node_types: tuple[NodeType, ...] | None
    max_workers: int | None = None
    running: Mapping[str, int] = field(default_factory=dict)

    def describe_types(self) -> str:
        if self.node_types is None:
            return "unknown (could not read the autoscaler's node types)"
        if not self.node_types:
            return "none"
        text = "; ".join(t.describe() for t in self.node_types)
        return text + (f"; max_workers {self.max_workers} in all" if self.max_workers is not None else "")


@dataclass(frozen=True)
class AutoscalerReport:
    """What the autoscaler says now: nodes it is launching or starting, launches that failed, and
    whether it reported the waiting placement group as one no node type can hold."""

    known: bool = False
    pending: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    infeasible: bool = False
    running: Mapping[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        if not self.known:
            return "the autoscaler's status could not be read"
        parts = [f"pending: {', '.join(self.pending)}" if self.pending else "nothing pending"]
        if self.failed:
            parts.append(f"failed: {', '.join(self.failed)}")
        if self.infeasible:
            parts.append("no node type can hold the request")
        return "; ".join(parts)


# -- pure decisions ----------------------------------------------------------------------------------


def bundles_per_node(bundle: Mapping[str, float], resources: Mapping[str, float], node_type: bool = False) -> int:
    """How many ``bundle``s one node with ``resources`` holds (a node type: unlisted memory does not limit)."""
    counts = []
    for name, amount in bundle.items():
        if amount <= 0 or (node_type and name in _SIZED_BY_MACHINE and name not in resources):
            continue
        counts.append(math.floor(resources.get(name, 0.0) / amount + 1e-9))
    return min(counts) if counts else UNBOUNDED


def added_capacity(
    bundle: Mapping[str, float],
    node_types: Sequence[NodeType],
    max_workers: int | None,
    running: Mapping[str, int],
    spread: bool,
) -> int:
    """How many ``bundle``s the nodes the autoscaler may still add could hold (``spread``: one per node).

    Each type adds up to its ``max_workers`` minus its nodes up now, all types together up to the
    cluster's ``max_workers`` minus all worker nodes up now; the types holding most go first.
    """
    up = sum(running.get(t.name, 0) for t in node_types)  # worker nodes: the head is not one of the types
    room = UNBOUNDED if max_workers is None else max(0, max_workers - up)
    per_type = []
    for node_type in node_types:
        each = bundles_per_node(bundle, node_type.resources, node_type=True)
        each = min(each, 1) if spread else each
        count = UNBOUNDED if node_type.max_workers is None else node_type.max_workers - running.get(node_type.name, 0)
        if each > 0 and count > 0:
            per_type.append((each, count))
    total = 0
    for each, count in sorted(per_type, reverse=True):
        nodes = min(count, room)
        if nodes >= UNBOUNDED:
            return UNBOUNDED
        total, room = total + each * nodes, room - nodes
    return min(total, UNBOUNDED)


def node_types_from_config(config: Mapping[str, Any]) -> tuple[tuple[NodeType, ...] | None, int | None]:
    """The worker node types and cluster-wide ``max_workers`` of an autoscaling config (``ray up``'s YAML).

    A type without ``resources`` makes them all unknown (None): what it could hold cannot be judged.
    """
    types = config.get("available_node_types")
    if not isinstance(types, Mapping):
        return None, None
    cluster_max = _whole(config.get("max_workers"))
    found = []
    for name, spec in types.items():
        if name == config.get("head_node_type") or not isinstance(spec, Mapping):
            continue
        resources = spec.get("resources")
        if not isinstance(resources, Mapping) or not resources:
            return None, cluster_max
        own_max = _whole(spec.get("max_workers"))
        found.append(NodeType(str(name), _amounts(resources), own_max if own_max is not None else cluster_max))
    return tuple(found), cluster_max


def monitor_arguments(cmdline: Sequence[str]) -> dict[str, str] | None:
    """``--gcs-address`` and ``--autoscaling-config`` of an autoscaler monitor's command line, else None."""
    if not any(arg.replace(os.sep, "/").endswith(ray_state.MONITOR_SCRIPTS) for arg in cmdline):
        return None
    found: dict[str, str] = {}
    for index, arg in enumerate(cmdline):
        for name in ("--gcs-address", "--autoscaling-config"):
            if arg.startswith(name + "="):
                found[name[2:]] = arg.split("=", 1)[1]
            elif arg == name and index + 1 < len(cmdline):
                found[name[2:]] = cmdline[index + 1]
    return found


def same_gcs(address: str | None, other: str) -> bool:
    """Whether two GCS addresses name one cluster: equal, or on one port (127.0.0.1 vs the node's IP)."""
    if not address:
        return False
    return address == other or address.rsplit(":", 1)[-1] == other.rsplit(":", 1)[-1]


def report_from_v1_status(status: Mapping[str, Any]) -> AutoscalerReport:
    """An :class:`AutoscalerReport` from autoscaler v1's ``__autoscaling_status`` (what ``ray status`` reads)."""
    report = status.get("autoscaler_report") or {}
    pending = [f"launching {count} {kind}" for kind, count in (report.get("pending_launches") or {}).items()]
    pending += [f"{entry[1]} ({entry[2]})" for entry in report.get("pending_nodes") or [] if len(entry) >= 3]
    failed = [f"{entry[1]} at {entry[0]}" for entry in report.get("failed_nodes") or [] if len(entry) >= 2]
    availability = (report.get("node_availability_summary") or {}).get("node_availabilities") or {}
    for kind, record in availability.items():
        info = (record or {}).get("unavailable_node_information") or {}
        if not (record or {}).get("is_available", True) and info:
            failed.append(f"{kind}: {info.get('category', '')} {info.get('description', '')}".strip())
    running = {k: int(v) for k, v in (report.get("active_nodes") or {}).items()}
    return AutoscalerReport(True, tuple(pending), tuple(failed), False, running)


def report_from_v2_reply(reply: Any, pg_id_hex: str | None) -> AutoscalerReport:
    """An :class:`AutoscalerReport` from autoscaler v2's ``GetClusterStatusReply`` (a protobuf)."""
    state = reply.autoscaling_state
    pending = [f"launching {r.count} {r.ray_node_type_name}" for r in state.pending_instance_requests]
    pending += [f"{i.ray_node_type_name} ({i.details or 'starting'})" for i in state.pending_instances]
    failed = [f"{r.count} {r.ray_node_type_name}: {r.reason}" for r in state.failed_instance_requests]
    infeasible = bool(pg_id_hex) and any(
        g.details.split(":", 1)[0] == pg_id_hex for g in state.infeasible_gang_resource_requests
    )
    running: dict[str, int] = {}
    for node in reply.cluster_resource_state.node_states:
        if node.ray_node_type_name and ray_state.node_is_up(node):
            running[node.ray_node_type_name] = running.get(node.ray_node_type_name, 0) + 1
    return AutoscalerReport(True, tuple(pending), tuple(failed), infeasible, running)


def _amounts(resources: Mapping[str, Any]) -> dict[str, float]:
    return {str(k): float(v) for k, v in resources.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def _whole(value: Any) -> int | None:
    """A node count from a config; negative or missing means no bound."""
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0 else None


def fmt_count(count: int) -> str:
    return "any number" if count >= UNBOUNDED else fmt_amount(count)


# -- reading the cluster -----------------------------------------------------------------------------


def find_autoscaler(timeout_s: float = READ_TIMEOUT_S) -> Autoscaler | None:
    """The cluster's autoscaler and what it can launch; None when the cluster has none."""
    from_gcs = _from_gcs_cluster_config()
    version = from_gcs.version if from_gcs is not None else _version()
    if version is None:
        return None
    running = read_report(version).running
    if from_gcs is not None:
        return Autoscaler(from_gcs.version, from_gcs.node_types, from_gcs.max_workers, running)
    config = _read_head_config(timeout_s)
    node_types, max_workers = node_types_from_config(config) if config is not None else (None, None)
    return Autoscaler(version, node_types, max_workers, running)


def read_report(version: str, pg_id_hex: str | None = None) -> AutoscalerReport:
    """What the autoscaler reports now (an unknown report when it cannot be read)."""
    try:
        if version == "v2":
            return report_from_v2_reply(ray_state.cluster_status(timeout_s=_GCS_TIMEOUT_S), pg_id_hex)
        status = kv.autoscaling_status()
        return report_from_v1_status(status) if status else AutoscalerReport()
    except Exception:  # noqa: BLE001 - Ray's internal status: unreadable means unknown
        return AutoscalerReport()


def _version() -> str | None:
    """The autoscaler's version ("v1", "v2") when the cluster runs one that launches nodes, else None.

    Without one, Ray still runs a read-only monitor, whose status names nodes ``node_<id>``.
    """
    try:
        if kv.autoscaler_v2_enabled():
            return "v2"
        status = kv.autoscaling_status() or {}
        report = status.get("autoscaler_report") or {}
        kinds = [*(report.get("node_type_mapping") or {}).values(), *(report.get("active_nodes") or {})]
        real = [kind for kind in kinds if not str(kind).startswith("node_")]
        return "v1" if real else None
    except Exception:  # noqa: BLE001 - as above
        return None


def _from_gcs_cluster_config() -> Autoscaler | None:
    """The node groups an autoscaler v2 deployment (KubeRay) stored in the GCS, if any."""
    try:
        config = ray_state.cluster_config()
        if config is None or not config.node_group_configs:
            return None
        types = tuple(
            NodeType(g.name, _amounts(dict(g.resources)), g.max_count if g.max_count >= 0 else None)
            for g in config.node_group_configs
        )
        return Autoscaler("v2", types)
    except Exception:  # noqa: BLE001 - as above
        return None


def _read_head_config(timeout_s: float) -> dict | None:
    """The autoscaling config the head's monitor runs with: read here when this driver runs on the
    head node (``ray submit``), else by a task there (its worker process may take seconds to start)."""
    try:
        if _driver_on_head():
            return _monitor_config()
        ref = _monitor_config_task().remote()
        ready, _ = ray.wait([ref], timeout=timeout_s)
        if not ready:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
            return None
        return ray.get(ref)
    except Exception:  # noqa: BLE001 - as above
        return None


def _driver_on_head() -> bool:
    from ray.util.client import ray as client

    if client.is_connected():  # a Ray Client's process is not on the cluster
        return False
    own = ray.get_runtime_context().get_node_id()
    return any(n["NodeID"] == own and HEAD_RESOURCE in n["Resources"] for n in ray.nodes() if n.get("Alive"))


@functools.cache
def _monitor_config_task() -> Any:
    # 0 CPUs: a head with CPU: 0 (the usual cloud setup) still runs it.
    return ray.remote(_monitor_config).options(num_cpus=0, resources={HEAD_RESOURCE: 0.001}, max_retries=0)


def _monitor_config() -> dict | None:
    """On the head node: the autoscaling config of the monitor process that serves this cluster."""
    import psutil

    own = ray.get_runtime_context().gcs_address
    for process in psutil.process_iter(["cmdline", "cwd"]):
        found = monitor_arguments(process.info.get("cmdline") or [])
        if not found or "autoscaling-config" not in found or not same_gcs(found.get("gcs-address"), own):
            continue
        path = os.path.join(process.info.get("cwd") or "/", os.path.expanduser(found["autoscaling-config"]))
        return _load_config(path)
    return None


def _load_config(path: str) -> dict | None:
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except ValueError:
        import yaml

        loaded = yaml.safe_load(text)
        return loaded if isinstance(loaded, dict) else None
