"""The worker group on its own, with real Ray: startup failures name the rank, and one shutdown cleans up."""

from __future__ import annotations

import pytest
import ray
from ray.util.placement_group import placement_group_table

from ray_lightning.config.resources import resolve_worker_resources
from ray_lightning.errors import RayWorkerError, WorkerStartupError
from ray_lightning.launch.placement import OwnPlacement
from ray_lightning.launch.worker_group import WorkerGroup
from tests.conftest import alive_worker_actors, wait_for

pytestmark = pytest.mark.usefixtures("ray_local")


def test_a_worker_dying_while_starting_is_named_and_everything_is_released():
    request = resolve_worker_resources(2)
    placement = OwnPlacement.reserve(request, placement_timeout_s=60)
    group = WorkerGroup.start(placement, request)
    victim = 1
    ray.kill(group.actors[victim], no_restart=True)
    with pytest.raises(WorkerStartupError, match="died while starting") as caught:
        group.node_infos(timeout_s=60)
    assert isinstance(caught.value, RayWorkerError)
    assert caught.value.rank == group.ranks[victim].global_rank
    assert f"rank {caught.value.rank}" in str(caught.value)

    group.shutdown()
    wait_for(lambda: not alive_worker_actors(), 30, "the group's actors to stop")
    assert placement_group_table(placement.pg)["state"] == "REMOVED"
    group.shutdown()  # a second shutdown (Ctrl-C during clean-up) is harmless


@ray.remote(num_cpus=0)
def _peer_lost() -> None:
    raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:3504.")


@ray.remote(num_cpus=0)
def _raises_after(first: list) -> None:
    ray.wait(first)  # the peer's broken collective reaches the driver first, as it does when luck goes that way
    raise ValueError("rank one's own bug")


def test_a_rank_s_own_exception_is_blamed_before_its_peer_s_broken_collective():
    from ray_lightning.launch.poll import wait_for_outputs

    peer = _peer_lost.remote()
    own = _raises_after.remote([peer])
    with pytest.raises(RayWorkerError) as caught:
        wait_for_outputs([peer, own], [0, 1], [], channel=None)
    assert caught.value.rank == 1 and "rank one's own bug" in str(caught.value)
