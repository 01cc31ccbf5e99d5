"""Processes a worker group starts before it needs them, so that a restart or a grow waits for none to start.

* **Spares** (:meth:`~.worker_group.WorkerGroup.keep_spares`): a fit that may restart keeps one per node, an actor
  that reserves nothing, started while the fit trains, whose imports (torch, Lightning: seconds) are done when a
  worker dies; :meth:`~.worker_group.WorkerGroup.salvage` puts it in the dead worker's place. Growth law: one idle
  process per node of the group (its memory: the imports, about 0.4 GB), no CPU or GPU reserved.
* **Newcomers** (:class:`Newcomers`): an elastic fit below its most workers starts a worker in each of its own
  bundles placed and unused (a lost node's, placed again; room reserved for a grow, :meth:`~.worker_group.WorkerGroup.
  extend`), while it trains; the grow into them (:mod:`.elastic`) waits until they are up. Growth law: one process per
  such bundle (at most ``max - min``), holding that bundle's reservation, which is the fit's anyway.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError

from ray_lightning.config.resources import WorkerResources
from ray_lightning.launch.session import driver_niceness

# The rank a spare (or newcomer) process is started with (its log lines say "spare"); it takes one when it runs a call.
SPARE_RANK = -1
# How long a spare that is done importing has to answer before it is taken as gone (it answers in milliseconds).
SPARE_ANSWER_S = 2.0
# Read by ray_lightning/__init__ in a spare's process (written out there: that import cannot wait for this module's).
IMPORT_NICENESS_ENV = "RAY_LIGHTNING_IMPORT_NICENESS"
# Resources that give a process a device (Ray makes it visible to the process that reserved it): no spare then.
ACCELERATORS = frozenset({"GPU", "TPU", "neuron_cores", "HPU", "NPU"})


def spares_possible(request: WorkerResources) -> bool:
    """Whether ``request``'s workers may have spares: not with an accelerator, which a process gets by reserving it
    (such a worker's replacement is a new process)."""
    reserved = {"GPU": request.gpus, **request.custom}
    return not any(amount and name in ACCELERATORS for name, amount in reserved.items())


def spare_environment(request: WorkerResources) -> dict[str, str]:
    """A spare's variables: it imports at the driver's niceness (ray_lightning/__init__), and its torch uses as many
    threads as a worker that reserved the CPUs (Ray gives a process that reserved none one thread)."""
    variables = {}
    niceness = driver_niceness()
    if niceness is not None:
        variables[IMPORT_NICENESS_ENV] = str(niceness)
    job = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
    if "OMP_NUM_THREADS" not in job:  # else the spare inherits the job's, as the workers do
        variables["OMP_NUM_THREADS"] = str(max(1, math.floor(request.cpus)))
    return variables


def spare_usable(spare: tuple[Any, Any]) -> bool:
    """Whether a spare (its actor, its start-up call) may take a worker's place: one still importing may (it is sooner
    ready than a new process), one done answers a new call within :data:`SPARE_ANSWER_S` (a dead one fails it at once:
    killed, out of memory, its node lost)."""
    actor, started = spare
    if not ray.wait([started], timeout=0)[0]:
        return True
    answer = actor.node_info.remote()
    return bool(ray.wait([answer], timeout=SPARE_ANSWER_S)[0]) and not died(answer)


def died(ref: Any) -> bool:
    """Whether the actor that ran the call ``ref`` (which ended) died in it."""
    try:
        ray.get(ref, timeout=0)
    except RayActorError:
        return True
    except Exception:  # noqa: BLE001 - it raised (a broken collective): its process is alive
        pass
    return False


class Newcomers:
    """The workers started in a group's own bundles placed and unused (a lost node's placed again, room reserved for a
    grow), by (placement group, bundle), until the group takes them."""

    def __init__(self) -> None:
        self._started: dict[tuple[Any, int], tuple[Any, Any]] = {}  # (group id, bundle): (actor, its start-up call)

    def up(self, placed: list[tuple[Any, int, str]], start: Callable[[tuple[Any, int]], Any]) -> int:
        """Start a worker (``start((group, bundle))``) in each bundle of ``placed`` (group, bundle, node) without one;
        how many of them are up (imported and answering)."""
        keys = [((pg.id, bundle), (pg, bundle)) for pg, bundle, _ in placed]
        for key, slot in keys:
            if key not in self._started:
                actor = start(slot)
                self._started[key] = (actor, actor.node_info.remote())
        return sum(1 for key, _ in keys if ray.wait([self._started[key][1]], timeout=0)[0])

    def take(self, slot: tuple[Any, int]) -> Any | None:
        """The worker started in ``slot`` (group, bundle), if one is there and alive (or still starting); a dead one
        is let go."""
        actor, started = self._started.pop((slot[0].id, slot[1]), (None, None))
        if actor is not None and ray.wait([started], timeout=0)[0] and died(started):
            kill(actor)
            return None
        return actor

    def stop(self) -> None:
        for actor, _ in self._started.values():
            kill(actor)
        self._started = {}


def kill(actor: Any) -> None:
    """Stop ``actor`` (one already gone is fine)."""
    with contextlib.suppress(Exception):
        ray.kill(actor, no_restart=True)
