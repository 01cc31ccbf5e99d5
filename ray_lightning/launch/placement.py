"""Where the workers go: the placement group they run in.

Each way of placing workers is a class (as horovod.ray's placement strategies are):
:meth:`OwnPlacement.reserve` reserves a placement group of its own (a bundle per worker, or per
host with ``num_hosts``), waiting at most ``placement_timeout_s``; :meth:`TrialPlacement.within`
uses the bundles of the placement group the caller already runs in (a Ray Tune trial's, made by
:func:`trial_bundles`), whose bundle 0 is the trial's own process. Both have ``release``.

Whether the cluster can ever hold the workers is checked first (:mod:`.capacity`: the alive nodes, and on a
cluster with an autoscaler (:mod:`.autoscaler`) the nodes its node types could add); the wait for the
reservation, up to ``scale_up_timeout_s`` where only new nodes can hold it, is :mod:`.placement_wait`'s; an
elastic fit's size, probed, is :mod:`.probes`'.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from ray_lightning.config.display import describe_totals
from ray_lightning.config.resources import WorkerResources
from ray_lightning.config.timeouts import DEFAULT_SCALE_UP_TIMEOUT_S
from ray_lightning.errors import ClusterResourceError
from ray_lightning.launch.autoscaler import find_autoscaler
from ray_lightning.launch.capacity import ClusterNow, check_cluster_can_hold
from ray_lightning.launch.placement_wait import wait_placed

log = logging.getLogger(__name__)

# A Tune trial's placement group: bundle 0 holds the trial's own process, which only waits for its
# workers and reports; the workers take the bundles after it.
TRIAL_BUNDLE_INDEX = 0
TRIAL_BUNDLE = {"CPU": 1.0}


def trial_bundles(request: WorkerResources) -> list[dict[str, float]]:
    """The bundles a Tune trial that trains on ``request``'s workers reserves, bundle 0 its own."""
    return [dict(TRIAL_BUNDLE)] + [request.bundle() for _ in range(request.num_workers)]


@dataclass
class Placement:
    """The placement groups a launch's workers run in: worker ``i`` draws from bundle ``bundles[i]`` of ``groups[i]``
    on ``nodes[i]``. ``groups`` is ``pg`` for every worker, but for those an elastic fit grew into room beyond its
    reservation: those draw from ``extensions``, groups reserved for that grow (:meth:`extend`), owned as ``pg`` is."""

    pg: Any
    bundles: list[int]
    nodes: list[str]
    owned: bool = field(default=True)
    groups: list[Any] = field(default_factory=list)
    extensions: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.groups:
            self.groups = [self.pg] * len(self.bundles)

    def _read(self, groups: list[Any]) -> tuple[dict[Any, tuple[dict[int, str], bool]], set[str]]:
        """For each of ``groups`` (by id) where Ray has its bundles now and whether it is placed whole (a group Ray no
        longer knows is left out), and the alive nodes: one read of the node list for them all."""
        try:
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        except Exception:  # noqa: BLE001 - a cluster that cannot answer has nothing placed
            return {}, set()
        tables = {}
        for pg in groups:
            with contextlib.suppress(Exception):  # a group Ray no longer knows is not placed
                table = placement_group_table(pg)
                tables[pg.id] = (table.get("bundles_to_node_id") or {}, table.get("state") == "CREATED")
        return tables, alive

    def nodes_now(self) -> list[str | None]:
        """Each worker's bundle's node now: None where the node is not alive, or the bundle moved and the group is not
        placed yet (a lost node's bundles are placed again by Ray, elsewhere, where there is room)."""
        tables, alive = self._read(list({g.id: g for g in self.groups}.values()))
        now: list[str | None] = []
        for pg, bundle, was in zip(self.groups, self.bundles, self.nodes):
            where, placed = tables.get(pg.id, ({}, False))
            node = where.get(bundle)
            now.append(node if node in alive and (placed or node == was) else None)
        return now

    def keep(self, workers: list[int], nodes: list[str]) -> None:
        """Go on with the workers ``workers`` only (indices, in order), now on ``nodes``."""
        self.bundles = [self.bundles[i] for i in workers]
        self.groups = [self.groups[i] for i in workers]
        self.nodes = list(nodes)

    def placed_unused(self) -> list[tuple[Any, int, str]]:
        """(group, bundle, node) of this launch's own groups' bundles that no worker uses and that are placed on alive
        nodes, in order: room a group that went on without a lost node's bundles has again once Ray placed them anew,
        and room reserved beyond (:meth:`extend`), for an elastic grow."""
        if not self.owned:
            return []
        used = {(g.id, b) for g, b in zip(self.groups, self.bundles)}
        owned = [self.pg, *self.extensions]
        tables, alive = self._read(owned)
        unused = []
        for pg in owned:
            where, _ = tables.get(pg.id, ({}, False))
            unused += [(pg, b, where[b]) for b in sorted(where) if (pg.id, b) not in used and where[b] in alive]
        return unused

    def add(self, pg: Any, bundle: int, node: str) -> None:
        """A worker in ``bundle`` of ``pg`` (one of this launch's own groups) joins, on ``node``."""
        self.groups.append(pg)
        self.bundles.append(bundle)
        self.nodes.append(node)

    def extend(self, pg: Any) -> None:
        """Own ``pg`` too (placed, for an elastic grow): its bundles are room to grow into, released with the rest."""
        self.extensions.append(pg)

    def release_unused(self) -> None:
        """Give back the groups reserved for a grow (:meth:`extend`) that no worker draws from."""
        used = {pg.id for pg in self.groups}
        for pg in [pg for pg in self.extensions if pg.id not in used]:
            self.extensions.remove(pg)
            give_back(pg)

    def release(self) -> None:
        """Give the reservations back, if they are this launch's own."""
        if self.owned:
            for pg in [self.pg, *self.extensions]:
                give_back(pg)
            self.extensions = []


def give_back(pg: Any | None) -> None:
    """Remove placement group ``pg`` (None: nothing); one already gone, or a cluster gone, is fine."""
    if pg is not None:
        with contextlib.suppress(Exception):
            remove_placement_group(pg)


class OwnPlacement(Placement):
    """A placement group of the launch's own, removed when its workers stop."""

    @classmethod
    def reserve(
        cls,
        request: WorkerResources,
        placement_timeout_s: float,
        scale_up_timeout_s: float = DEFAULT_SCALE_UP_TIMEOUT_S,
        say: Callable[[str], None] | None = None,
    ) -> OwnPlacement:
        """Check ``request`` against the cluster and reserve it as a placement group of its own.

        A request no alive node nor any node the autoscaler could add can ever hold fails at once
        (:func:`check_cluster_can_hold`). One the alive nodes can hold is waited for up to
        ``placement_timeout_s``; one only the autoscaler's nodes can hold, up to ``scale_up_timeout_s``;
        one the alive nodes could hold but are busy, while the autoscaler could add nodes, by the longer
        of both. Meanwhile ``say`` (default: this module's logger at INFO) reports what is pending.
        """
        say = say or log.info
        cluster = ClusterNow.read()
        autoscaler = None
        try:
            check_cluster_can_hold(request, cluster.resources)
        except ClusterResourceError as error:
            autoscaler = find_autoscaler()
            if autoscaler is None:
                raise
            check_cluster_can_hold(request, cluster.resources, autoscaler)
            if autoscaler.node_types is None:
                say(f"ray_lightning: {error} The autoscaler may still add nodes that can; what it launches is unknown.")
        bundles, strategy = request.placement()
        pg = placement_group(bundles, strategy=strategy)
        try:
            wait_placed(pg, request, autoscaler, cluster, (placement_timeout_s, scale_up_timeout_s), say)
        except BaseException:
            remove_placement_group(pg)
            raise
        return cls.placed(pg, request)

    @classmethod
    def placed(cls, pg: Any, request: WorkerResources) -> OwnPlacement:
        """The placement of ``request``'s workers in ``pg``, which is ready."""
        bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
        indices = [request.bundle_index(i) for i in range(request.num_workers)]
        return cls(pg, indices, [bundle_nodes[b] for b in indices], owned=True)


class TrialPlacement(Placement):
    """Bundles of a placement group the caller already runs in (a Tune trial's); left in place afterwards."""

    @classmethod
    def within(cls, pg: Any, request: WorkerResources, wait_s: float = 0.0) -> TrialPlacement:
        """The first bundles after the trial's own that can each hold one worker.

        A bundle whose node was lost is placed again by Ray where there is room (or on a node the
        autoscaler adds): this waits up to ``wait_s`` for every bundle to be placed.
        """
        if request.num_hosts:
            raise ClusterResourceError(
                "num_hosts/num_slots cannot be used inside a placement group (e.g. a Ray Tune trial), whose "
                "bundles are already placed; use num_workers."
            )
        need = request.bundle()
        specs = pg.bundle_specs
        fitting = [
            i
            for i, spec in enumerate(specs)
            if i != TRIAL_BUNDLE_INDEX and all(spec.get(k, 0) >= v for k, v in need.items())
        ]
        if len(fitting) < request.num_workers:
            reserved = ", ".join(describe_totals(spec) for spec in specs)
            raise ClusterResourceError(
                f"This fit runs inside a placement group (a Ray Tune trial's) that reserved [{reserved}]: "
                f"bundle {TRIAL_BUNDLE_INDEX} for the trial itself and {len(fitting)} that can each hold a worker, "
                f"but it needs {request.describe()}. Reserve them with "
                "resources_per_trial=ray_lightning.tune.get_tune_resources("
                "num_workers=..., num_cpus_per_worker=..., use_gpu=..., resources_per_worker=...) "
                "(or tune.with_resources(train_fn, get_tune_resources(...)))."
            )
        indices = fitting[: request.num_workers]
        if placement_group_table(pg).get("state") != "CREATED" and not pg.wait(wait_s):
            raise ClusterResourceError(
                f"Bundles of this Tune trial's placement group were lost with their node and were not placed "
                f"again within {wait_s:g} s; the cluster has {describe_totals(ray.available_resources())} free. "
                "Tune retries the trial if its max_failures allows."
            )
        bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
        return cls(pg, indices, [bundle_nodes[b] for b in indices], owned=False)
