"""The Ray this process talks to, and what the workers need to know about the driver's process."""

from __future__ import annotations

import os
import sys

import ray

from ray_lightning.launch.priority import current_niceness


def ensure_ray_initialized() -> None:
    """Use the Ray this process is connected to, else ``RAY_ADDRESS``'s cluster, else start a local one."""
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"))


def ray_session() -> str | None:
    """Identifies the Ray session this process is connected to (None if none)."""
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    return f"{context.gcs_address}/{context.get_job_id()}"


def driver_node_id() -> str | None:
    """The Ray node this process runs on; None for a Ray Client, whose machine is no node of the cluster."""
    if ray.util.client.ray.is_connected():
        return None
    return ray.get_runtime_context().get_node_id()


def driver_niceness() -> int | None:
    """The niceness the workers take during a call (:mod:`.priority`); None for a Ray Client, whose process is
    no part of the cluster."""
    if ray.util.client.ray.is_connected():
        return None
    return current_niceness()


def driver_sys_path() -> tuple[str, ...]:
    """Where this process imports from, for workers on its machine (a Ray Client's paths mean nothing there)."""
    if ray.util.client.ray.is_connected():
        return ()
    # "" is the working directory (notebooks, `python -c`); workers have their own.
    return tuple(os.path.abspath(p) if p == "" else p for p in sys.path)


def alive_node_ids() -> set[str]:
    """The ids of the cluster's nodes that are alive now (empty when the cluster cannot be asked)."""
    try:
        return {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
    except Exception:  # noqa: BLE001 - a cluster that cannot answer: no node counts as alive
        return set()
