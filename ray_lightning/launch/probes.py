"""How many workers the cluster places now: an elastic fit's size, found by probing placement groups of a
few sizes (:func:`most_placed`), each removed at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ray.util.placement_group import placement_group, remove_placement_group

from ray_lightning.config.resources import WorkerResources
from ray_lightning.config.timeouts import DEFAULT_SCALE_UP_TIMEOUT_S
from ray_lightning.errors import ClusterResourceError
from ray_lightning.launch.capacity import ClusterNow, check_cluster_can_hold
from ray_lightning.launch.placement import OwnPlacement
from ray_lightning.launch.placement_wait import placed_within

# How long an elastic fit's probe waits for a placement group of one size (reserve_elastic, free_room). A group the
# free resources hold is placed in milliseconds; 2 s leaves a busy cluster's scheduler time, and a probe is gone
# before the autoscaler's next look at pending demand (every 5 s by default), so it is not read as sustained demand.
PROBE_S = 2.0


def reserve_elastic(
    request: WorkerResources,
    min_workers: int,
    placement_timeout_s: float,
    scale_up_timeout_s: float = DEFAULT_SCALE_UP_TIMEOUT_S,
    say: Callable[[str], None] | None = None,
) -> OwnPlacement:
    """The most of ``request``'s workers (``request.num_workers`` at most, ``min_workers`` at least) placed now.

    The sizes above ``min_workers`` are probed by :func:`most_placed` (at most ``ceil(log2(max - min)) + 1``
    placement groups, each given :data:`PROBE_S`; a size the alive nodes could never hold is not asked for), then
    the size found is reserved; when none is placed at once, ``min_workers`` are reserved as a fixed-size fit's
    workers are (:meth:`OwnPlacement.reserve`: waiting within the bounds).
    """
    size = most_placed(min_workers, request.num_workers, _prober(request))
    if size > min_workers:
        pg = placed_at_once(request.with_workers(size))
        if pg is not None:  # else another job took the room since the probe: the wait below
            return OwnPlacement.placed(pg, request.with_workers(size))
    return OwnPlacement.reserve(request.with_workers(min_workers), placement_timeout_s, scale_up_timeout_s, say)


def free_room(request: WorkerResources, most: int) -> int:
    """How many more of ``request``'s workers (``most`` at most) the cluster's free resources hold now.

    Asked with placement groups of those sizes (:func:`most_placed`, each removed at once), so Ray decides it as
    it would place them.
    """
    return most_placed(0, most, _prober(request))


def most_placed(low: int, high: int, places: Callable[[int], bool]) -> int:
    """The largest size in ``(low, high]`` for which ``places`` is true, or ``low`` if none.

    ``high`` first (a cluster with room answers in one probe), then bisection, on the rule that a cluster that
    places ``n`` workers places fewer: at most ``ceil(log2(high - low)) + 1`` calls of ``places``, not one per
    size (``num_workers=(64, 512)``: 10 placement groups, not up to 448 of up to 512 bundles each).
    """
    if high <= low:
        return low
    if places(high):
        return high
    fits, fails = low, high
    while fails - fits > 1:
        size = (fits + fails) // 2
        if places(size):
            fits = size
        else:
            fails = size
    return fits


def _prober(request: WorkerResources) -> Callable[[int], bool]:
    """Whether Ray places ``request`` at a size at once, asked with a placement group removed at once (not asked,
    false, for a size the alive nodes could never hold)."""
    nodes = ClusterNow.read().resources

    def places(size: int) -> bool:
        sized = request.with_workers(size)
        try:
            check_cluster_can_hold(sized, nodes)
        except ClusterResourceError:
            return False
        pg = placed_at_once(sized)
        if pg is None:
            return False
        remove_placement_group(pg)
        return True

    return places


def placed_at_once(request: WorkerResources) -> Any | None:
    """A placement group of ``request`` if Ray places it within :data:`PROBE_S` (else none is left behind)."""
    bundles, strategy = request.placement()
    pg = placement_group(bundles, strategy=strategy)
    if placed_within(pg.ready(), PROBE_S):
        return pg
    remove_placement_group(pg)
    return None
