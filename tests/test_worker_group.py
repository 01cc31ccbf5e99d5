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
