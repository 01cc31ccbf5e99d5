"""How a placement group is waited for: within ``placement_timeout_s`` on busy nodes, or up to
``scale_up_timeout_s`` for the nodes the autoscaler adds, saying what is pending and what came up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray

from ray_lightning.config.display import describe_totals
from ray_lightning.config.resources import WorkerResources
from ray_lightning.config.variables import SCALE_UP_TIMEOUT_ENV
from ray_lightning.errors import ClusterResourceError
from ray_lightning.launch.autoscaler import (
    Autoscaler,
    AutoscalerReport,
    added_capacity,
    find_autoscaler,
    read_report,
)
from ray_lightning.launch.capacity import ClusterNow

# A placement that fits the alive nodes is placed at once unless they are busy: only after this
# long is the autoscaler asked whether it could add nodes. While the autoscaler works, its report
# is read this often (it may say that no node type can hold the request), and the driver reports
# progress every PROGRESS_INTERVAL_S.
CHECK_INTERVAL_S = 5.0
PROGRESS_INTERVAL_S = 20.0


def _busy_error(request: WorkerResources, timeout_s: float) -> ClusterResourceError:
    memory = "memory" in request.bundle()
    return ClusterResourceError(
        f"Could not reserve {request.describe()} within {timeout_s:g} s "
        f"(placement_timeout_s). The cluster has {describe_totals(ray.cluster_resources(), memory)}, "
        f"of which {describe_totals(ray.available_resources(), memory)} are free now; other jobs or "
        "trials may hold the rest. Use fewer workers, wait for them to finish, or raise "
        "placement_timeout_s."
    )


def wait_placed(
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
        if placed_within(ready, min(placement_s, CHECK_INTERVAL_S)):
            return
        autoscaler = find_autoscaler()
        if autoscaler is None or not _could_add(autoscaler, request):
            if placed_within(ready, placement_s - (time.monotonic() - started)):
                return
            raise _busy_error(request, placement_s)
        # It waits for free resources, and new nodes would bring some: the longer of both bounds.
        scale_up_s = max(scale_up_s, placement_s)
    _ScaleUpWait(ready, pg.id.hex(), request, autoscaler, scale_up_s, say, started, dict(cluster.nodes)).run()


def placed_within(ready: ray.ObjectRef, timeout_s: float) -> bool:
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
            if placed_within(self.ready, min(self.timeout_s - self._elapsed(), CHECK_INTERVAL_S)):
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
