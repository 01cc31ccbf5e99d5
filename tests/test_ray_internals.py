"""Every private Ray name ray_lightning relies on still exists; a failure names what moved.

The names live in ray_lightning._ray (the one folder allowed to use them, tests/test_layers.py);
when a Ray release moves one, this is the test that says which, and where it used to be.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest
import ray

from ray_lightning._ray import PRIVATE_NAMES, kv, state
from ray_lightning.launch.autoscaler import report_from_v2_reply

MOVED = (
    "Ray moved a private name ray_lightning relies on: {}. Update ray_lightning/_ray/ (the only place that uses it)."
)


@pytest.mark.usefixtures("ray_local")  # the GCS client of a connected process is one of them
@pytest.mark.parametrize("private", PRIVATE_NAMES, ids=lambda p: f"{p.where}.{p.name}")
def test_private_ray_name_still_exists(private):
    missing = private.missing()
    assert missing is None, MOVED.format(missing)


def test_a_moved_name_is_reported(monkeypatch):
    from ray.experimental import internal_kv

    monkeypatch.delattr(internal_kv, "_internal_kv_get")
    entry = next(p for p in PRIVATE_NAMES if p.name == "_internal_kv_get")
    missing = entry.missing()
    assert missing == "ray.experimental.internal_kv has no _internal_kv_get (no '_internal_kv_get' on module)"
    assert MOVED.format(missing).startswith("Ray moved a private name ray_lightning relies on: ray.experimental")


def test_a_moved_module_is_reported():
    entry = next(p for p in PRIVATE_NAMES if p.name == "state.get_draining_nodes")
    entry = dataclasses.replace(entry, owner=lambda: importlib.import_module("ray._private.no_such_state"))
    assert entry.missing().startswith("ray._private.state: cannot get it (ModuleNotFoundError: ")


@pytest.mark.parametrize("ours", sorted(kv.RAY_KEY_NAMES))
def test_the_autoscaler_keys_are_the_ones_ray_names(ours):
    module, name = kv.RAY_KEY_NAMES[ours]
    theirs = getattr(importlib.import_module(module), name, None)
    assert theirs == ours, MOVED.format(f"{module}.{name} is {theirs!r}, no longer {ours!r}")


@pytest.mark.parametrize("script", state.MONITOR_SCRIPTS)
def test_the_autoscaler_monitor_scripts_are_where_ray_keeps_them(script):
    path = Path(ray.__file__).parent / script
    assert path.is_file(), MOVED.format(f"the autoscaler's monitor script ray/{script} is gone")


def test_the_named_node_statuses_are_rays():
    from ray.core.generated import autoscaler_pb2

    field = autoscaler_pb2.NodeState.DESCRIPTOR.fields_by_name["status"]
    assert field.enum_type.name == "NodeStatus", MOVED.format(f"NodeState.status is a {field.enum_type.name}")
    names = dict(autoscaler_pb2.NodeStatus.items())
    assert state.up_node_statuses() == {names["RUNNING"], names["IDLE"]}
    for name, number in names.items():
        assert state.node_is_up(autoscaler_pb2.NodeState(status=number)) == (name in ("RUNNING", "IDLE")), name


def test_nodes_up_are_counted_by_their_status_name():
    from ray.core.generated import autoscaler_pb2

    reply = autoscaler_pb2.GetClusterStatusReply()
    for name in ("RUNNING", "IDLE", "DEAD", "DRAINING", "RUNNING"):
        node = reply.cluster_resource_state.node_states.add()
        node.ray_node_type_name = "gpu"
        node.status = autoscaler_pb2.NodeStatus.Value(name)
    assert dict(report_from_v2_reply(reply, None).running) == {"gpu": 3}
