"""An elastic fit finds its size by bisection: few placement groups per decision, on a real Ray cluster too."""

from __future__ import annotations

import math

import pytest

from ray_lightning.config.resources import WorkerResources
from ray_lightning.launch import placement
from ray_lightning.launch import probes as probes_module
from ray_lightning.launch.probes import free_room, most_placed, reserve_elastic


@pytest.mark.parametrize("low, high", [(0, 1), (1, 2), (2, 3), (1, 8), (0, 13), (64, 512)])
def test_bisection_finds_the_most_that_fit_within_the_probe_bound(low, high):
    for room in range(0, high + 3):
        asked = []

        def places(size, room=room, asked=asked):
            asked.append(size)
            return size <= room

        assert most_placed(low, high, places) == min(max(room, low), high), (room, asked)
        assert len(asked) <= math.ceil(math.log2(high - low)) + 1, (room, asked)


def test_an_elastic_start_on_a_busy_cluster_probes_a_few_sizes_and_takes_the_most_free(ray_local, monkeypatch):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    # Another job holds one of the cluster's four custom_accel: three are free, four exist.
    other = placement_group([{"custom_accel": 1}])
    ray.get(other.ready(), timeout=60)
    probes = []

    def counted(bundles, strategy):
        probes.append(len(bundles))
        return placement_group(bundles, strategy=strategy)

    monkeypatch.setattr(probes_module, "placement_group", counted)
    monkeypatch.setattr(placement, "placement_group", counted)
    request = WorkerResources(num_workers=16, cpus=1, gpus=0, custom={"custom_accel": 1})
    try:
        own = reserve_elastic(request, min_workers=1, placement_timeout_s=30)
        try:
            assert len(own.bundles) == 3, "the three free ones"
            # 16 and 8 the cluster could never hold (4 exist): not asked for; then 4 (busy), 2, 3, and the 3 kept.
            assert probes == [4, 2, 3, 3]
            assert free_room(request, most=13) == 0, "nothing more is free"
            assert probes[4:] == [3, 1], "13 and 6 are more than exist; 3 and 1 asked for, neither placed"
        finally:
            own.release()
    finally:
        remove_placement_group(other)
