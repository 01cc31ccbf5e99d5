"""What the autoscaler's node types could hold, decided without Ray (see tests/test_autoscaling.py for a real one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.core.generated.autoscaler_pb2 import GetClusterStatusReply

from ray_lightning import ClusterResourceError
from ray_lightning.config.resources import resolve_worker_resources
from ray_lightning.launch.autoscaler import (
    UNBOUNDED,
    Autoscaler,
    AutoscalerReport,
    NodeType,
    added_capacity,
    bundles_per_node,
    monitor_arguments,
    node_types_from_config,
    report_from_v1_status,
    report_from_v2_reply,
    same_gcs,
)
from ray_lightning.launch.capacity import check_cluster_can_hold

ROOT = Path(__file__).resolve().parents[1]
ACCEL = NodeType("accel_node", {"CPU": 1, "accel": 1, "object_store_memory": 1e8}, max_workers=2)
HEAD = {"CPU": 1.0, "memory": 1e9, "node:__internal_head__": 1.0}


def test_bundles_per_node_counts_whole_bundles():
    assert bundles_per_node({"CPU": 1, "accel": 1}, {"CPU": 4, "accel": 2}) == 2
    assert bundles_per_node({"CPU": 0.5}, {"CPU": 2}) == 4
    assert bundles_per_node({"CPU": 1, "GPU": 1}, {"CPU": 8}) == 0
    # A node type that does not list memory is not limited by it; an alive node lists it.
    assert bundles_per_node({"CPU": 1, "memory": 1e9}, {"CPU": 2}, node_type=True) == 2
    assert bundles_per_node({"CPU": 1, "memory": 1e9}, {"CPU": 2}) == 0


def test_added_capacity_respects_each_type_and_the_cluster_bound():
    small = NodeType("small", {"CPU": 2}, max_workers=3)
    big = NodeType("big", {"CPU": 8}, max_workers=1)
    bundle = {"CPU": 1.0}
    assert added_capacity(bundle, [small, big], None, {}, spread=False) == 3 * 2 + 8
    # Two nodes in all: the type holding most goes first.
    assert added_capacity(bundle, [small, big], 2, {}, spread=False) == 8 + 2
    # Nodes up now count against both bounds (the head, not a type, does not).
    assert added_capacity(bundle, [small, big], 4, {"small": 2, "head": 1}, spread=False) == 8 + 2
    assert added_capacity(bundle, [small, big], None, {}, spread=True) == 4
    assert added_capacity({"GPU": 1.0}, [small, big], None, {}, spread=False) == 0
    assert added_capacity(bundle, [NodeType("any", {"CPU": 1})], None, {}, spread=False) == UNBOUNDED


def test_node_types_from_the_shipped_cluster_yaml():
    config = yaml.safe_load((ROOT / "examples" / "cluster.yaml").read_text())
    types, max_workers = node_types_from_config(config)
    assert max_workers == 4
    assert types == (NodeType("gpu_worker", {"CPU": 8.0, "GPU": 1.0}, 4),)


def test_node_types_from_config_defaults_and_unknowns():
    config = {
        "max_workers": 5,
        "head_node_type": "head",
        "available_node_types": {"head": {"resources": {"CPU": 1}}, "w": {"resources": {"CPU": 2}}},
    }
    assert node_types_from_config(config) == ((NodeType("w", {"CPU": 2.0}, 5),), 5)
    # A type whose resources Ray would detect from the instance: what any type holds is unknown.
    config["available_node_types"]["x"] = {"node_config": {}}
    assert node_types_from_config(config) == (None, 5)
    assert node_types_from_config({}) == (None, None)


def test_monitor_command_line_and_gcs_address():
    cmdline = [
        "/venv/bin/python",
        "-u",
        "/venv/lib/python3.11/site-packages/ray/autoscaler/_private/monitor.py",
        "--logs-dir=/tmp/ray/session_x/logs",
        "--gcs-address=192.0.2.2:6379",
        "--autoscaling-config=~/ray_bootstrap_config.yaml",
    ]
    found = monitor_arguments(cmdline)
    assert found == {"gcs-address": "192.0.2.2:6379", "autoscaling-config": "~/ray_bootstrap_config.yaml"}
    assert monitor_arguments(["python", "x/ray/_private/log_monitor.py", "--gcs-address=a:1"]) is None
    assert same_gcs("127.0.0.1:6379", "192.0.2.2:6379") and not same_gcs("192.0.2.2:6380", "192.0.2.2:6379")
    assert not same_gcs(None, "192.0.2.2:6379")


def test_v1_status_report():
    status = {
        "autoscaler_report": {
            "active_nodes": {"ray.head.default": 1, "accel_node": 1},
            "pending_nodes": [["fff3", "accel_node", "uninitialized"]],
            "pending_launches": {"accel_node": 1},
            "failed_nodes": [["10.0.0.9", "accel_node"]],
            "node_availability_summary": {
                "node_availabilities": {
                    "accel_node": {
                        "is_available": False,
                        "unavailable_node_information": {"category": "InsufficientCapacity", "description": "none"},
                    }
                }
            },
        }
    }
    report = report_from_v1_status(status)
    assert report.pending == ("launching 1 accel_node", "accel_node (uninitialized)")
    assert report.failed == ("accel_node at 10.0.0.9", "accel_node: InsufficientCapacity none")
    assert report.running == {"ray.head.default": 1, "accel_node": 1}
    assert "pending: launching 1 accel_node" in report.summary() and "failed:" in report.summary()
    assert report_from_v1_status({}).summary() == "nothing pending"
    assert AutoscalerReport().summary() == "the autoscaler's status could not be read"


def test_v2_reply_report_flags_this_placement_group_infeasible():
    reply = GetClusterStatusReply()
    state = reply.autoscaling_state
    state.pending_instance_requests.add(ray_node_type_name="gpu", count=2)
    state.failed_instance_requests.add(ray_node_type_name="gpu", count=1, reason="no spot capacity")
    state.infeasible_gang_resource_requests.add(details="abc123:PACK|PENDING")
    reply.cluster_resource_state.node_states.add(ray_node_type_name="gpu", status=1)
    report = report_from_v2_reply(reply, "abc123")
    assert report.pending == ("launching 2 gpu",) and report.failed == ("1 gpu: no spot capacity",)
    assert report.infeasible and report.running == {"gpu": 1}
    assert not report_from_v2_reply(reply, "other").infeasible


def _autoscaler(*types: NodeType, max_workers: int | None = None) -> Autoscaler:
    return Autoscaler("v1", tuple(types), max_workers)


def test_gpu_nodes_the_autoscaler_adds_count():
    # examples/cluster.yaml: a head with CPU 0, GPU workers with min_workers 0.
    gpu = NodeType("gpu_worker", {"CPU": 8, "GPU": 1}, 4)
    request = resolve_worker_resources(4, 1, True)
    with pytest.raises(ClusterResourceError, match="no GPUs"):
        check_cluster_can_hold(request, [{"CPU": 0.0}])
    check_cluster_can_hold(request, [{"CPU": 0.0}], _autoscaler(gpu, max_workers=4))
    too_many = resolve_worker_resources(5, 1, True)
    with pytest.raises(ClusterResourceError, match=r"at most 4 of the 5 worker\(s\) fit: 0 on the alive nodes"):
        check_cluster_can_hold(too_many, [{"CPU": 0.0}], _autoscaler(gpu, max_workers=4))


@pytest.mark.parametrize(
    "resources, message",
    [
        ({"CPU": 1, "GPU": 1}, r"can hold one worker \{CPU: 1, GPU: 1\}\. No node and no node type has GPUs"),
        ({"CPU": 1, "acel": 1}, r"No node and no node type has 'acel'\. Did you mean 'accel'\?"),
        ({"CPU": 2, "accel": 1}, r"can hold one worker \{CPU: 2, accel: 1\}\. Alive nodes"),
    ],
)
def test_what_no_node_and_no_node_type_holds_fails_naming_both(resources, message):
    request = resolve_worker_resources(1, 1, False, resources)
    with pytest.raises(ClusterResourceError, match=message) as info:
        check_cluster_can_hold(request, [HEAD], _autoscaler(ACCEL))
    text = str(info.value)
    assert "Alive nodes: {CPU: 1}." in text
    assert "Node types the autoscaler can launch: accel_node {CPU: 1, accel: 1} (up to 2)" in text


def test_hosts_count_one_per_added_node():
    request = resolve_worker_resources(3, 1, False, {"accel": 1}, num_hosts=3)
    with pytest.raises(ClusterResourceError, match=r"at most 2 of the 3 host\(s\) fit"):
        check_cluster_can_hold(request, [HEAD], _autoscaler(ACCEL))
    check_cluster_can_hold(resolve_worker_resources(2, 1, False, {"accel": 1}, num_hosts=2), [HEAD], _autoscaler(ACCEL))


def test_unknown_node_types_leave_it_to_the_wait():
    request = resolve_worker_resources(1, 1, False, {"anything": 1})
    check_cluster_can_hold(request, [HEAD], Autoscaler("v1", None))
    with pytest.raises(ClusterResourceError, match="which no node in the Ray cluster has"):
        check_cluster_can_hold(request, [HEAD])
