"""A fit opens no listener on every interface: its own ports bind the workers' Ray node IP.

The one wildcard listener every Ray process has is Ray's own core-worker gRPC server; it is
identified by the port the actor table records for the actor, not by elimination.
"""

from __future__ import annotations

import psutil
import pytest
import pytorch_lightning as pl
import ray

from ray_lightning import HorovodRayStrategy, RayStrategy
from ray_lightning.horovod.hvd import unreachable_hostname
from ray_lightning.launch.network import interface_for, listener_environment, listening_socket
from ray_lightning.launch.rendezvous import open_bound_store
from tests.models import BoringModel, Listeners, read_records

WILDCARD = ("0.0.0.0", "::")


def _ray_grpc_port(actor_id: str) -> int:
    # The port of the actor's core-worker gRPC server, from the GCS actor table (Ray's developer API).
    return ray._private.state.actors(actor_id)["Address"]["Port"]


def _two_fits(strategy: object, tmp_path) -> list[list[dict]]:
    """Two fits on the same (reused) workers; per fit, each rank's listeners during training."""
    fits = []
    for name in ("first", "second"):
        trainer = pl.Trainer(
            max_epochs=1,
            limit_train_batches=2,
            limit_val_batches=0,
            strategy=strategy,
            callbacks=[Listeners(tmp_path, name)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
        )
        trainer.fit(BoringModel())
        fits.append(read_records(tmp_path, name, "listeners"))
    assert [r["pid"] for r in fits[0]] == [r["pid"] for r in fits[1]], "the second fit should reuse the workers"
    return fits


def _check_bound_to_node_ip(record: dict) -> list[tuple[str, int]]:
    """Only Ray's own server listens on every interface; the rest on the node IP. Returns the rest."""
    listening = [tuple(pair) for pair in record["listening"]]
    wildcard = [port for ip, port in listening if ip in WILDCARD]
    assert wildcard == [_ray_grpc_port(record["actor_id"])], (
        f"rank {record['global_rank']} listens on every interface at ports {wildcard}; only Ray's own "
        f"core-worker server ({_ray_grpc_port(record['actor_id'])}) may: {listening}"
    )
    ours = [(ip, port) for ip, port in listening if ip not in WILDCARD]
    assert {ip for ip, _ in ours} <= {record["node_ip"]}, f"rank {record['global_rank']}: {listening}"
    return ours


def test_a_ddp_fit_listens_on_the_node_ip_only(ray_local, tmp_path):
    first, second = _two_fits(RayStrategy(num_workers=2), tmp_path)
    for fit in (first, second):
        rank_zero, rank_one = fit
        ours = [_check_bound_to_node_ip(r) for r in fit]
        # Rank 0: the TCPStore and its gloo listener; rank 1: its gloo listener. All on the node IP.
        assert (rank_zero["node_ip"], rank_zero["master_port"]) in ours[0]
        assert len(ours[0]) == 2 and len(ours[1]) == 1
        assert rank_zero["gloo_socket_ifname"] == rank_one["gloo_socket_ifname"] == interface_for(rank_zero["node_ip"])
    # The first fit's store closed with its call.
    assert first[0]["master_port"] not in [port for _, port in second[0]["listening"]]


def test_a_horovod_fit_listens_on_the_node_ip_only(ray_local, tmp_path):
    pytest.importorskip("horovod.torch", reason="Horovod is not installed: `python3 dev.py test` builds it")
    first, second = _two_fits(HorovodRayStrategy(num_workers=2), tmp_path)
    for fit in (first, second):
        rank_zero = fit[0]
        ours = [_check_bound_to_node_ip(r) for r in fit]
        # Rank 0's actor runs Horovod's rendezvous server, on its node IP.
        assert rank_zero["horovod_rendezvous"] == rank_zero["node_ip"]
        assert (rank_zero["node_ip"], rank_zero["horovod_rendezvous_port"]) in ours[0]
    # The first fit's rendezvous server stopped listening when its call ended.
    assert first[0]["horovod_rendezvous_port"] not in [port for _, port in second[0]["listening"]]


def _listening_here() -> list[tuple[str, int]]:
    connections = psutil.Process().net_connections(kind="inet")
    return [(c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN]


def test_the_store_listens_on_the_address_it_is_given():
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = open_bound_store("127.0.0.1", timeout_s=10)
    assert ("127.0.0.1", store.port) in _listening_here()
    assert not [pair for pair in _listening_here() if pair[1] == store.port and pair[0] in WILDCARD]
    client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("key", "value")
    assert store.get("key") == b"value"
    port = store.port
    del client, store
    assert port not in [p for _, p in _listening_here()]


def test_a_listening_socket_binds_one_address():
    with listening_socket("127.0.0.1") as sock:
        host, port = sock.getsockname()
        assert host == "127.0.0.1" and port > 0
        assert ("127.0.0.1", port) in _listening_here()


@pytest.mark.parametrize(
    "backend, environ, expected",
    [
        ("gloo", {}, {"GLOO_SOCKET_IFNAME": "eth0"}),
        ("nccl", {}, {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}),
        ("cpu:gloo,cuda:nccl", {}, {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}),
        # The user's own choice wins.
        ("nccl", {"NCCL_SOCKET_IFNAME": "ib0"}, {"GLOO_SOCKET_IFNAME": "eth0"}),
        ("gloo", {"GLOO_SOCKET_IFNAME": "lo"}, {}),
    ],
)
def test_process_group_listeners_use_the_node_ips_interface(backend, environ, expected):
    assert listener_environment(backend, "eth0", environ) == expected


def test_no_interface_found_changes_nothing():
    assert listener_environment("nccl", None, {}) == {}
    assert interface_for("203.0.113.77") is None  # an address no interface here carries
    assert interface_for("127.0.0.1") is not None


@pytest.mark.parametrize(
    "address, refused",
    [("10.0.0.5", None), ("fe80::1", None), ("127.0.0.1", "resolves to 127.0.0.1"), ("127.0.1.1", "127.0.1.1"),
     ("::1", "resolves to ::1"), (None, "does not resolve")],
)  # fmt: skip
def test_horovod_across_machines_needs_a_reachable_hostname(address, refused):
    problem = unreachable_hostname("vm", address, "10.0.0.5")
    if refused is None:
        assert problem is None
    else:
        assert refused in problem
        assert "'vm'" in problem and "HOROVOD_GLOO_IFACE" in problem and "10.0.0.5" in problem
