"""Where the workers go: whether the cluster can ever hold them, and the placement group they run in.

Each way of placing workers is a class (as horovod.ray's placement strategies are):
:meth:`OwnPlacement.reserve` reserves a placement group of its own (a bundle per worker, or per
host with ``num_hosts``), waiting at most ``placement_timeout_s``; :meth:`TrialPlacement.within`
uses the bundles of the placement group the caller already runs in (a Ray Tune trial's, made by
:func:`trial_bundles`), whose bundle 0 is the trial's own process. Both have ``release``.

On a cluster with an autoscaler (:mod:`.autoscaler`), :meth:`OwnPlacement.reserve` also counts
the nodes its node types could add: a request only they can hold is waited for, up to
``scale_up_timeout_s`` (cloud nodes take minutes), reporting what is pending and what came up.
Each decision reads the cluster once (:class:`ClusterNow`).
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from ray_lightning.config.display import describe_totals, fmt_amount, fmt_resource
from ray_lightning.config.resources import WorkerResources
from ray_lightning.config.timeouts import DEFAULT_SCALE_UP_TIMEOUT_S
from ray_lightning.config.variables import SCALE_UP_TIMEOUT_ENV
from ray_lightning.errors import ClusterResourceError
from ray_lightning.launch.autoscaler import (
    Autoscaler,
    AutoscalerReport,
    NodeType,
    added_capacity,
    bundles_per_node,
    find_autoscaler,
    fmt_count,
    read_report,
)

log = logging.getLogger(__name__)

# A placement that fits the alive nodes is placed at once unless they are busy: only after this
# long is the autoscaler asked whether it could add nodes. While the autoscaler works, its report
# is read this often (it may say that no node type can hold the request), and the driver reports
# progress every PROGRESS_INTERVAL_S.
CHECK_INTERVAL_S = 5.0
PROGRESS_INTERVAL_S = 20.0
# How long an elastic fit's probe waits for a placement group of one size (reserve_elastic, free_room). A group the
# free resources hold is placed in milliseconds; 2 s leaves a busy cluster's scheduler time, and a probe is gone
# before the autoscaler's next look at pending demand (every 5 s by default), so it is not read as sustained demand.
PROBE_S = 2.0

# A Tune trial's placement group: bundle 0 holds the trial's own process, which only waits for its
# workers and reports; the workers take the bundles after it.
TRIAL_BUNDLE_INDEX = 0
TRIAL_BUNDLE = {"CPU": 1.0}


def trial_bundles(request: WorkerResources) -> list[dict[str, float]]:
    """The bundles a Tune trial that trains on ``request``'s workers reserves, bundle 0 its own."""
    return [dict(TRIAL_BUNDLE)] + [request.bundle() for _ in range(request.num_workers)]


@dataclass(frozen=True)
class ClusterNow:
    """The cluster's alive nodes at one moment: node id -> total resources."""

    nodes: Mapping[str, Mapping[str, float]]

    @classmethod
    def read(cls) -> ClusterNow:
        return cls({n["NodeID"]: n["Resources"] for n in ray.nodes() if n.get("Alive")})

    @property
    def resources(self) -> list[dict[str, float]]:
        """Each alive node's total resources."""
        return [dict(r) for r in self.nodes.values()]


def check_cluster_can_hold(
    request: WorkerResources, nodes: list[dict[str, float]], autoscaler: Autoscaler | None = None
) -> None:
    """Fail at once when no waiting could ever place ``request`` on the alive ``nodes``.

    ``nodes`` holds each alive node's total resources (``ray.nodes()[i]["Resources"]``). With an
    ``autoscaler``, what its node types could add counts too (unknown node types: nothing fails).
    A request that only lacks *free* resources is left to the bounded placement wait.
    """
    try:
        _check_alive_nodes(request, nodes)
    except ClusterResourceError:
        if autoscaler is None:
            raise
        if autoscaler.node_types is not None:
            _check_with_node_types(request, nodes, autoscaler)


def _check_alive_nodes(request: WorkerResources, nodes: list[dict[str, float]]) -> None:
    """What a cluster without an autoscaler checks; each error names the request and the alive nodes."""
    totals: dict[str, float] = {}
    for node in nodes:
        for name, amount in node.items():
            totals[name] = totals.get(name, 0.0) + amount
    bundle = request.bundle()
    _check_kinds(bundle, totals)
    # Memory is shown (in GiB...) when the request asks for it: it may be what blocks it.
    asks_memory = "memory" in bundle

    def describe(resources: dict[str, float]) -> str:
        return describe_totals(resources, memory=asks_memory)

    if not any(all(node.get(k, 0) >= v for k, v in bundle.items()) for node in nodes):
        raise ClusterResourceError(
            f"No single node can hold one worker {describe(bundle)}; "
            f"the nodes have: {'; '.join(describe(n) for n in nodes)}. "
            "Ask for fewer resources per worker."
        )
    if request.num_hosts:
        per_host = {k: v * request.workers_per_host for k, v in bundle.items()}
        fitting = sum(all(node.get(k, 0) >= v for k, v in per_host.items()) for node in nodes)
        if fitting < request.num_hosts:
            raise ClusterResourceError(
                f"Asked for {request.describe()}: {request.num_hosts} different nodes that each hold "
                f"{describe(per_host)}, but only {fitting} of the cluster's {len(nodes)} node(s) can "
                f"(the nodes have: {'; '.join(describe(n) for n in nodes)}). "
                "Use fewer hosts or slots, or num_workers to let Ray pack the workers."
            )
    for name, amount in bundle.items():
        if amount * request.num_workers > totals.get(name, 0) + 1e-9:
            raise ClusterResourceError(
                f"Asked for {request.describe()} = {fmt_resource(name, amount * request.num_workers)} {name} in all, "
                f"but the whole Ray cluster has {fmt_resource(name, totals.get(name, 0))} {name} "
                f"({describe(totals)}). Use fewer workers or fewer resources per worker."
            )


def _check_kinds(bundle: dict[str, float], totals: dict[str, float]) -> None:
    """Every resource the request names exists somewhere in the cluster (GPUs, custom resources)."""
    for name, amount in bundle.items():
        if name == "GPU" and totals.get("GPU", 0) == 0:
            raise ClusterResourceError(
                f"Asked for {fmt_amount(amount)} GPU per worker (use_gpu=True or resources_per_worker['GPU']), "
                f"but the Ray cluster has no GPUs ({describe_totals(totals)}). "
                "Set use_gpu=False to train on CPUs, or connect to a cluster with GPU nodes."
            )
        if name not in totals:
            known = sorted(k for k in totals if not k.startswith("node:") and "_group_" not in k)
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ClusterResourceError(
                f"resources_per_worker asks for {name!r}, which no node in the Ray cluster has.{hint} "
                f"The cluster has: {', '.join(known)}."
            )


def _check_with_node_types(request: WorkerResources, nodes: list[dict[str, float]], autoscaler: Autoscaler) -> None:
    """Fail when neither the alive nodes nor those the autoscaler may still add can hold ``request``."""
    assert autoscaler.node_types is not None
    bundles, strategy = request.placement()
    bundle, spread = bundles[0], strategy == "STRICT_SPREAD"
    on_alive = sum(min(n, 1) if spread else n for n in (bundles_per_node(bundle, node) for node in nodes))
    added = added_capacity(bundle, autoscaler.node_types, autoscaler.max_workers, autoscaler.running, spread)
    if on_alive + added >= len(bundles):
        return
    memory = "memory" in bundle
    where = (
        f"Alive nodes: {'; '.join(describe_totals(n, memory) for n in nodes) or 'none'}. "
        f"Node types the autoscaler can launch: {autoscaler.describe_types()}."
    )
    if not on_alive and not any(bundles_per_node(bundle, t.resources, node_type=True) for t in autoscaler.node_types):
        what = f"one host's {request.workers_per_host} worker(s)" if spread else "one worker"
        raise ClusterResourceError(
            f"Neither a node of the Ray cluster nor a node type its autoscaler can launch can hold {what} "
            f"{describe_totals(bundle, memory)}.{_missing_hint(bundle, nodes, autoscaler.node_types)} {where} "
            "Ask for fewer resources per worker, or add a node type that has them to the cluster's config "
            "(available_node_types)."
        )
    unit = "host(s)" if spread else "worker(s)"
    raise ClusterResourceError(
        f"Asked for {request.describe()}, but at most {fmt_count(on_alive + added)} of the {len(bundles)} {unit} "
        f"fit: {on_alive} on the alive nodes and {fmt_count(added)} on the nodes the autoscaler may still add. "
        f"{where} Use fewer workers, or raise max_workers in the cluster's config."
    )


def _missing_hint(bundle: dict[str, float], nodes: list[dict[str, float]], node_types: Sequence[NodeType]) -> str:
    """What the request names that no node and no node type has, with the closest name they do have."""
    known = {k for r in [*nodes, *(t.resources for t in node_types)] for k in r}
    known = {k for k in known if not k.startswith("node:") and "_group_" not in k}
    hints = []
    for name in sorted(set(bundle) - known):
        if name == "GPU":
            hints.append(" No node and no node type has GPUs: set use_gpu=False to train on CPUs.")
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        hints.append(f" No node and no node type has {name!r}." + (f" Did you mean {close[0]!r}?" if close else ""))
    return "".join(hints)


@dataclass
class Placement:
    """The placement group a launch's workers run in: worker ``i`` draws from bundle ``bundles[i]`` on ``nodes[i]``."""

    pg: Any
    bundles: list[int]
    nodes: list[str]
    owned: bool = field(default=True)

    def still_placed(self) -> bool:
        """Whether every bundle is still where it was placed, on a node that is alive."""
        try:
            table = placement_group_table(self.pg)
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        except Exception:  # noqa: BLE001 - a group Ray no longer knows is not placed
            return False
        where = table.get("bundles_to_node_id") or {}
        return table.get("state") == "CREATED" and all(
            where.get(bundle) == node and node in alive for bundle, node in zip(self.bundles, self.nodes)
        )

    def release(self) -> None:
        """Give the reservation back, if it is this launch's own."""
        if self.owned:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)


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
            _wait_placed(pg, request, autoscaler, cluster, (placement_timeout_s, scale_up_timeout_s), say)
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
        pg = _placed_at_once(request.with_workers(size))
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
        pg = _placed_at_once(sized)
        if pg is None:
            return False
        remove_placement_group(pg)
        return True

    return places


def _placed_at_once(request: WorkerResources) -> Any | None:
    """A placement group of ``request`` if Ray places it within :data:`PROBE_S` (else none is left behind)."""
    bundles, strategy = request.placement()
    pg = placement_group(bundles, strategy=strategy)
    if _placed(pg.ready(), PROBE_S):
        return pg
    remove_placement_group(pg)
    return None


def _busy_error(request: WorkerResources, timeout_s: float) -> ClusterResourceError:
    memory = "memory" in request.bundle()
    return ClusterResourceError(
        f"Could not reserve {request.describe()} within {timeout_s:g} s "
        f"(placement_timeout_s). The cluster has {describe_totals(ray.cluster_resources(), memory)}, "
        f"of which {describe_totals(ray.available_resources(), memory)} are free now; other jobs or "
        "trials may hold the rest. Use fewer workers, wait for them to finish, or raise "
        "placement_timeout_s."
    )


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


def _wait_placed(
    pg: Any,
    request: WorkerResources,
    autoscaler: Autoscaler | None,
    cluster: ClusterNow,
    bounds: tuple[float, float],
    say: Callable[[str], None],
) -> None:
    """Until ``pg`` is placed; without ``autoscaler`` (the alive nodes can hold it) ask for one only if it waits.

    ``bounds``: ``(placement_timeout_s, scale_up_timeout_s)``; ``cluster``: the nodes before the wait.
    """
    (placement_s, scale_up_s), ready, started = bounds, pg.ready(), time.monotonic()
    if autoscaler is None:
        if _placed(ready, min(placement_s, CHECK_INTERVAL_S)):
            return
        autoscaler = find_autoscaler()
        if autoscaler is None or not _could_add(autoscaler, request):
            if _placed(ready, placement_s - (time.monotonic() - started)):
                return
            raise _busy_error(request, placement_s)
        # It waits for free resources, and new nodes would bring some: the longer of both bounds.
        scale_up_s = max(scale_up_s, placement_s)
    _ScaleUpWait(ready, pg.id.hex(), request, autoscaler, scale_up_s, say, started, dict(cluster.nodes)).run()


def _placed(ready: ray.ObjectRef, timeout_s: float) -> bool:
    done, _ = ray.wait([ready], timeout=max(0.0, timeout_s))
    return bool(done)


def _could_add(autoscaler: Autoscaler, request: WorkerResources) -> bool:
    """Whether the autoscaler may still add a node that holds one of ``request``'s bundles (unknown: yes)."""
    if autoscaler.node_types is None:
        return True
    bundles, strategy = request.placement()
    spread = strategy == "STRICT_SPREAD"
    return added_capacity(bundles[0], autoscaler.node_types, autoscaler.max_workers, autoscaler.running, spread) > 0


@dataclass
class _ScaleUpWait:
    """Waiting for a placement group the autoscaler's nodes may hold: progress on the driver, and the
    error when the bound passes (what was asked, what came up, what the autoscaler said) or when the
    autoscaler reports that none of its node types can hold it."""

    ready: ray.ObjectRef
    pg_id: str
    request: WorkerResources
    autoscaler: Autoscaler
    timeout_s: float
    say: Callable[[str], None]
    started: float
    nodes_before: Mapping[str, Mapping[str, float]]
    report: AutoscalerReport = field(default_factory=AutoscalerReport)
    failures: list[str] = field(default_factory=list)

    def run(self) -> None:
        self.say(
            f"ray_lightning: waiting up to {self.timeout_s:g} s (scale_up_timeout_s) for the autoscaler to add "
            f"nodes for {self.request.describe()}; it can launch: {self.autoscaler.describe_types()}; "
            f"{self._nodes_text()}."
        )
        said = None
        while True:
            if _placed(self.ready, min(self.timeout_s - self._elapsed(), CHECK_INTERVAL_S)):
                elapsed = self._elapsed()
                self.say(
                    f"ray_lightning: reserved {self.request.describe()} after {elapsed:.0f} s; {self._nodes_text()}."
                )
                return
            self._read_report()
            if self._elapsed() >= self.timeout_s:
                raise self._timeout_error()
            if said is None or time.monotonic() - said >= PROGRESS_INTERVAL_S:
                said = time.monotonic()
                self.say(
                    f"ray_lightning: still waiting for {self.request.describe()} after {self._elapsed():.0f} of "
                    f"{self.timeout_s:g} s; autoscaler: {self.report.summary()}; {self._nodes_text()}."
                )

    def _elapsed(self) -> float:
        return time.monotonic() - self.started

    def _read_report(self) -> None:
        self.report = read_report(self.autoscaler.version, self.pg_id)
        self.failures += [f for f in self.report.failed if f not in self.failures]
        if self.report.infeasible:
            raise ClusterResourceError(
                f"The autoscaler reports that none of its node types can hold {self.request.describe()} "
                f"(placement group {self.pg_id}). Node types it can launch: {self.autoscaler.describe_types()}; "
                f"{self._nodes_text()}. Ask for fewer resources per worker, or add a node type that has them "
                "to the cluster's config."
            )

    def _nodes_text(self) -> str:
        now = ClusterNow.read().nodes
        new = [describe_totals(r) for node_id, r in now.items() if node_id not in self.nodes_before]
        gone = len([node_id for node_id in self.nodes_before if node_id not in now])
        text = f"{len(now)} node(s) up, {len(new)} new since the wait began" + (f": {'; '.join(new)}" if new else "")
        return text + (f", {gone} gone" if gone else "")

    def _timeout_error(self) -> ClusterResourceError:
        failures = f" Failed launches during the wait: {'; '.join(self.failures)}." if self.failures else ""
        return ClusterResourceError(
            f"Could not reserve {self.request.describe()} within {self.timeout_s:g} s (scale_up_timeout_s) while "
            f"waiting for the autoscaler to add nodes: {self._nodes_text()}; the cluster has "
            f"{describe_totals(ray.cluster_resources())}, of which {describe_totals(ray.available_resources())} "
            f"are free. The autoscaler reported: {self.report.summary()}.{failures} It can launch: "
            f"{self.autoscaler.describe_types()}. Cloud nodes can take minutes to start: raise scale_up_timeout_s "
            f"({SCALE_UP_TIMEOUT_ENV}); `ray status` on the head node shows what the autoscaler is doing."
        )
