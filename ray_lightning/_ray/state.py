"""The cluster's state as Ray's GCS keeps it for Ray's own tools, and the autoscaler that publishes part of it.

* :func:`draining_nodes`: ``ray._private.state.state.get_draining_nodes`` (Ray Train's preemption
  watcher polls the same; no public API tells which nodes are being drained, nor their deadline).
* :func:`cluster_config`: ``ray._private.state.state.get_cluster_config``, the node groups an
  autoscaler v2 deployment (KubeRay) stored.
* :func:`cluster_status`: autoscaler v2's ``GetClusterStatusReply`` (``ray.core.generated.autoscaler_pb2``),
  read with ``ray._private.worker.global_worker.gcs_client.get_cluster_status``, as
  ``ray.autoscaler.v2.sdk`` does; its nodes' statuses are the protobuf enum ``NodeStatus``, whose
  up ones :func:`node_is_up` names (:data:`UP_NODE_STATUSES`).
* :data:`MONITOR_SCRIPTS`: the files, inside Ray's package, of the monitor processes that run an
  autoscaler (v1, v2) on the head node: their command lines say which autoscaling config they run.

Every function raises what Ray raises (an ``ImportError`` where a name moved): callers decide what
a failure means.
"""

from __future__ import annotations

import functools
from typing import Any

GLOBAL_STATE = "ray._private.state"  # its `state`: the process's GlobalState
WORKER = "ray._private.worker"  # its `global_worker`: the connected worker, with its gcs_client
AUTOSCALER_PB2 = "ray.core.generated.autoscaler_pb2"
# The statuses of autoscaler v2's NodeState (enum NodeStatus) of a node that is up: busy or idle.
UP_NODE_STATUSES = ("RUNNING", "IDLE")
MONITOR_SCRIPTS = ("autoscaler/_private/monitor.py", "autoscaler/v2/monitor.py")


def _global_state() -> Any:
    from ray._private.state import state

    return state


def draining_nodes() -> dict[str, int]:
    """``{node id: drain deadline in ms since the epoch (0: none)}`` of the cluster's draining nodes."""
    return dict(_global_state().get_draining_nodes())


def cluster_config() -> Any:
    """The ``autoscaler_pb2.ClusterConfig`` an autoscaler v2 deployment stored (its ``node_group_configs``), or None."""
    return _global_state().get_cluster_config()


def cluster_status(timeout_s: float) -> Any:
    """Autoscaler v2's status: a ``GetClusterStatusReply`` (what it launches, what failed, every node's state)."""
    from ray._private import worker
    from ray.core.generated.autoscaler_pb2 import GetClusterStatusReply

    reply = GetClusterStatusReply()
    reply.ParseFromString(worker.global_worker.gcs_client.get_cluster_status(timeout_s=timeout_s))
    return reply


@functools.cache
def up_node_statuses() -> frozenset[int]:
    """The values of :data:`UP_NODE_STATUSES` in Ray's ``NodeStatus`` enum."""
    from ray.core.generated.autoscaler_pb2 import NodeStatus

    return frozenset(NodeStatus.Value(name) for name in UP_NODE_STATUSES)


def node_is_up(node: Any) -> bool:
    """Whether a ``NodeState`` of :func:`cluster_status` is of a node that is up (running or idle)."""
    return node.status in up_node_statuses()
