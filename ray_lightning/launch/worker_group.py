"""The actors of a launch: started in a placement, run a call, shut down.

A :class:`WorkerGroup` owns its actors, its driver channel and (when it is its own) its placement group.
:meth:`WorkerGroup.shutdown` is the one clean-up path: for a group that failed half-way through starting, whose call
failed, stopped by Ctrl-C, or idle and expired. Startup failures have their own types (:class:`~ray_lightning.errors.
WorkerStartupError`: an actor died before running the call; :class:`~ray_lightning.errors.WorkerStartupTimeoutError`).

Processes started before they are needed (a spare per node for a dead worker's place, newcomers for a grow) are
:mod:`.standby`'s.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_lightning.channel.driver_channel import DriverChannel
from ray_lightning.config.resources import WorkerResources
from ray_lightning.environment import WorkerRank, assign_ranks
from ray_lightning.errors import RayWorkerError, WorkersGrowError, WorkerStartupError, WorkerStartupTimeoutError
from ray_lightning.home.results import WorkerOutput
from ray_lightning.launch.actor import NodeInfo, RayWorker
from ray_lightning.launch.placement import Placement
from ray_lightning.launch.poll import wait_for_outputs
from ray_lightning.launch.rendezvous import Rendezvous, RendezvousPoint
from ray_lightning.launch.session import driver_node_id, ray_session
from ray_lightning.launch.standby import (
    SPARE_RANK,
    Newcomers,
    died,
    kill,
    spare_environment,
    spare_usable,
    spares_possible,
)
from ray_lightning.launch.watchdog import Watchdog
from ray_lightning.runtime import WorkerContext

log = logging.getLogger(__name__)

# The rendezvous (TCPStore, Horovod's Gloo) waits this many times worker_start_timeout_s for every rank to arrive:
# longer than the watchdog's startup bound, so a rank stuck before it (in init_hook) is named by the watchdog.
RENDEZVOUS_TIMEOUT_FACTOR = 2.0
# How often a group that lost a node reads whether Ray placed its bundles again (salvage's placed_wait_s).
PLACED_POLL_S = 0.5
# How long a grow waits for every rank to leave the call at its next batch (interrupt).
GROW_WAIT_S = 30.0


class WorkerGroup:
    """One actor per worker in ``placement``; ``ranks[i]`` is actor ``i``'s rank."""

    def __init__(self, placement: Placement, ranks: list[WorkerRank]) -> None:
        self.placement = placement
        self.ranks = ranks
        self.actors: list[Any] = []
        self.infos: list[NodeInfo] = []
        self.calls = 0  # calls run so far: more than 0 when the group is reused
        self._running: list[Any] = []  # the running call's refs, actor by actor
        self._let_go: set[Any] = set()  # the failed call's refs whose workers were asked to let go of it
        self.survivors: list[Any] = []  # after salvage: the actors whose processes came out of the broken call
        # Node id: a spare worker process there (keep_spares), with its start-up call's reference.
        self.spares: dict[str, tuple[Any, Any]] = {}
        self.spares_taken = 0  # by the last salvage
        self.newcomers = Newcomers()  # workers in the group's own bundles placed again, for a grow (held_room)
        self._request: WorkerResources | None = None
        self._channel: DriverChannel | None = None
        self._session = ray_session()

    @classmethod
    def start(cls, placement: Placement, request: WorkerResources) -> WorkerGroup:
        """Start one actor per worker in the placement's bundles.

        Ranks follow the nodes the bundles were placed on, so each actor knows its rank from the
        start (Ray prefixes its log lines with it).
        """
        group = cls(placement, assign_ranks(placement.nodes))
        group._request = request
        try:
            group.actors = [group._new_actor(i) for i in range(len(group.ranks))]
        except BaseException:
            group.shutdown()
            raise
        return group

    def _new_actor(self, i: int, spare: bool = False, slot: tuple[Any, int] | None = None) -> Any:
        """A worker actor for rank ``ranks[i]`` in its bundle (or in ``slot``, a group and a bundle, ``i`` -1: it takes
        a rank when it runs a call); ``spare``: one on that bundle's node reserving nothing (:meth:`keep_spares`)."""
        assert self._request is not None
        pg, bundle = slot or (self.placement.groups[i], self.placement.bundles[i])
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
        options = self._request.actor_options()
        if spare or i < 0:  # started before it is needed (.standby): it imports at the driver's niceness
            environment = {"runtime_env": {"env_vars": spare_environment(self._request)}}
            options = {"num_cpus": 0, **environment} if spare else {**options, **environment}
        rank = SPARE_RANK if spare or i < 0 else self.ranks[i].global_rank
        return ray.remote(RayWorker).options(**options, scheduling_strategy=strategy).remote(rank)

    def keep_spares(self, wanted: bool = True) -> None:
        """Start a spare worker process on each node of the group that has none alive (see the module docstring);
        not ``wanted``: stop those it has (a reused group's, for a call that keeps none).

        Only for workers without an accelerator: a spare reserves nothing, and a GPU (or a TPU...) is given to a
        process by what it reserves, so such a worker's replacement is a new process, as before.
        """
        assert self._request is not None
        if not wanted or not spares_possible(self._request):
            self.drop_spares()
            return
        for i, node in enumerate(self.placement.nodes):
            if node in self.spares and not spare_usable(self.spares[node]):
                kill(self.spares.pop(node)[0])
            if node not in self.spares:
                actor = self._new_actor(i, spare=True)
                self.spares[node] = (actor, actor.node_info.remote())

    def drop_spares(self) -> None:
        """Stop the spares."""
        for actor, _ in self.spares.values():
            kill(actor)
        self.spares = {}

    def salvage(
        self, wait_s: float, min_workers: int | None = None, placed_wait_s: float = 0.0, grow_to: int = 0
    ) -> WorkerGroup | None:
        """After a worker or node was lost in a call: this group, with new workers for those that cannot go on.

        The workers that came out of the broken call (their collectives failed with the peer's death)
        and say they can run another (:meth:`RayWorker.reusable`, within ``wait_s``) are kept: no new
        process, no imports. The dead ones, those still inside the call after ``wait_s`` (stuck in a
        collective) and those that do not answer are replaced in their own bundles, where a new
        process starts at once. A lost node's bundles are placed again by Ray where there is room: the group
        waits up to ``placed_wait_s`` for that and starts their workers there; an elastic fit (``min_workers``)
        does not wait, it goes on without the workers whose bundles are not placed, as long as ``min_workers``
        are left. Ranks are given again from where the workers are. None, with the group shut down, when no
        worker is left to keep or the bundles stay unplaced (the restart then starts a new group wherever the
        cluster can hold it). ``grow_to``: an elastic fit grows to this many workers into its own bundles placed and
        unused (its call ended by :meth:`interrupt`): a worker in each, the one started there meanwhile if it is up.
        """
        self._let_go_ended()
        self.spares_taken = 0
        running, self._running = self._running, []
        kept = self._placed_again(running, placed_wait_s if min_workers is None else 0.0, min_workers)
        if not kept:
            self.shutdown()
            return None
        if grow_to:
            self._add_placed(grow_to - len(self.actors))
        running = kept
        replaced: set[int] = set()
        for timeout in (0, wait_s):  # the dead ones' processes start first, then the stuck ones'
            ended, _ = ray.wait(running, num_returns=len(running), timeout=timeout)
            gone = {i for i, ref in enumerate(running) if (ref in ended and died(ref)) or timeout and ref not in ended}
            for i in gone - replaced:
                self._replace(i)
            replaced |= gone
        came_out = [i for i in range(len(running)) if i not in replaced]
        checks = [self.actors[i].reusable.remote() for i in came_out]
        answered, _ = ray.wait(checks, num_returns=len(checks), timeout=wait_s)
        for i, check in zip(came_out, checks):
            if check not in answered or not _answer(check):
                self._replace(i)
                replaced.add(i)
        self.survivors = [self.actors[i] for i in came_out if i not in replaced]
        self.infos = []  # asked again: the new actors' pids
        return self

    def _placed_again(self, running: list[Any], wait_s: float, min_workers: int | None) -> list[Any] | None:
        """The broken call's refs of the workers the group goes on with (see :meth:`salvage`), or None when it
        cannot: updates the workers' nodes, drops an elastic group's workers whose bundles are gone, and gives the
        ranks again."""
        deadline = time.monotonic() + wait_s
        now = self.placement.nodes_now()
        if None in now and wait_s > 0:
            lost = sum(node is None for node in now)
            log.warning("ray_lightning: waiting up to %g s for Ray to place %d lost worker(s) again", wait_s, lost)
        while None in now and time.monotonic() < deadline:
            time.sleep(PLACED_POLL_S)  # Ray places a lost node's bundles again by itself; nothing tells when
            now = self.placement.nodes_now()
        keep = [i for i, node in enumerate(now) if node is not None]
        if not keep or (len(keep) < len(now) and (min_workers is None or len(keep) < min_workers)):
            return None
        for i in set(range(len(now))) - set(keep):
            kill(self.actors[i])
        for node in set(self.spares) - set(now):  # its node is gone, and the spare with it
            kill(self.spares.pop(node)[0])
        self.actors = [self.actors[i] for i in keep]
        self.placement.keep(keep, [node for node in now if node is not None])
        self.ranks = assign_ranks(self.placement.nodes)
        return [running[i] for i in keep]

    def interrupt(self, wait_s: float) -> list[WorkerOutput | None] | None:
        """Cancel the running call; wait (``wait_s`` at most) until every rank left it, each that did letting go of
        its process group at once, so that one in a collective with it fails too instead of waiting for it.

        Returns every rank's output when each ended the call by itself meanwhile (the fit was past its last batch as
        the grow was decided), else None. Ray reports a task cancelled while it ran as cancelled even when it then
        returned, so the outputs are asked of the workers, which keep the last call's (:meth:`RayWorker.completed`).
        """
        for ref in self._running:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        deadline = time.monotonic() + wait_s
        while len(ray.wait(self._running, num_returns=len(self._running), timeout=0.1)[0]) < len(self._running):
            self._let_go_ended()
            if time.monotonic() >= deadline:
                return None
        try:
            kept = ray.get([actor.completed.remote() for actor in self.actors], timeout=wait_s)
        except Exception:  # noqa: BLE001 - a worker that cannot answer ended no call: the grow goes on
            return None
        if any(output is None for output in kept):
            self._let_go_ended()
            return None
        return [output[0] for output in kept]

    def held_room(self) -> int:
        """The group's own bundles placed that no worker uses (:meth:`Placement.placed_unused`: a lost node's placed
        again, room reserved beyond by :meth:`extend`) whose worker is up: one starts in each now, while the call
        trains (:class:`~.standby.Newcomers`)."""
        return self.newcomers.up(self.placement.placed_unused(), lambda slot: self._new_actor(-1, slot=slot))

    def extend(self, pg: Any) -> None:
        """Reserve ``pg`` (placed) for the group to grow into: a worker starts in each of its bundles at the next
        :meth:`held_room`, and joins with the next grow."""
        self.placement.extend(pg)

    def _add_placed(self, most: int) -> None:
        """A worker in each of the group's own bundles placed that no worker uses, ``most`` at most (the one started
        there by :meth:`held_room`, else a new one); ranks given again. A reserved group left without a worker is given
        back."""
        for pg, bundle, node in self.placement.placed_unused()[: max(0, most)]:
            self.placement.add(pg, bundle, node)
        self.ranks = assign_ranks(self.placement.nodes)
        new = range(len(self.actors), len(self.ranks))
        slots = [(self.placement.groups[i], self.placement.bundles[i]) for i in new]
        self.actors += [self.newcomers.take(slot) or self._new_actor(i) for i, slot in zip(new, slots)]
        self.newcomers.stop()  # any left: in bundles Ray moved meanwhile, or beyond the most
        self.placement.release_unused()

    def came_out(self, global_rank: int, wait_s: float) -> Any | None:
        """After a failed call: the actor of ``global_rank`` if its process comes out of the call alive within
        ``wait_s``, else None. The workers already out let go of the call first (:meth:`RayWorker.let_go`): one
        still waiting in a collective on them then fails too."""
        self._let_go_ended()
        i = next((i for i, r in enumerate(self.ranks) if r.global_rank == global_rank), len(self._running))
        if i >= len(self._running) or not ray.wait([self._running[i]], timeout=wait_s)[0] or died(self._running[i]):
            return None
        return self.actors[i]

    def _let_go_ended(self) -> None:
        """Have the workers whose part of the failed call ended, alive, free what it held (RayWorker.let_go), once."""
        ended, _ = ray.wait(self._running, num_returns=len(self._running), timeout=0)
        for i, ref in enumerate(self._running):
            if ref in ended and ref not in self._let_go and not died(ref):
                self._let_go.add(ref)
                self.actors[i].let_go.remote()

    def _replace(self, i: int) -> None:
        """Stop actor ``i``; the spare on its node takes its place (another spare starts there), else a new actor."""
        kill(self.actors[i])
        spare = self.spares.pop(self.placement.nodes[i], None)
        if spare is None or not spare_usable(spare):
            if spare is not None:
                kill(spare[0])
            self.actors[i] = self._new_actor(i)
            return
        self.actors[i] = spare[0]  # the node's next spare starts with the next attempt (keep_spares)
        self.spares_taken += 1

    @property
    def owns_placement(self) -> bool:
        return self.placement.owned

    def in_current_session(self) -> bool:
        """Whether the Ray this group was started in is still the one this process is connected to."""
        return ray.is_initialized() and ray_session() == self._session

    def channel(self) -> DriverChannel:
        """The queue workers send driver calls through; made on first use, kept as long as the group."""
        if self._channel is None:
            self._channel = DriverChannel(driver_node_id())
        return self._channel

    def node_infos(self, timeout_s: float) -> list[NodeInfo]:
        """Where each actor landed (asked once: a reused group's actors are where they were)."""
        if not self.infos:
            self.infos = self._get([a.node_info.remote() for a in self.actors], timeout_s, "report where they run")
        return self.infos

    def open_rendezvous(self, rendezvous: Rendezvous, nodes_by_rank: list[str], timeout_s: float) -> RendezvousPoint:
        """Have rank 0 open the rendezvous within ``timeout_s``; returns where the workers meet (the rendezvous
        itself waits ``RENDEZVOUS_TIMEOUT_FACTOR`` times longer for the ranks to arrive)."""
        rank_zero = next(i for i, r in enumerate(self.ranks) if r.global_rank == 0)
        wait_s = timeout_s * RENDEZVOUS_TIMEOUT_FACTOR
        ref = self.actors[rank_zero].open_rendezvous.remote(rendezvous, nodes_by_rank, wait_s)
        return self._get([ref], timeout_s, "open the rendezvous", actors=[rank_zero])[0]

    def _get(self, refs: list[Any], timeout_s: float, what: str, actors: list[int] | None = None) -> list[Any]:
        """``ray.get`` of startup calls (``refs[j]`` is on actor ``actors[j]``, default actor ``j``), bounded."""
        actors = actors if actors is not None else list(range(len(refs)))
        try:
            return ray.get(refs, timeout=timeout_s)
        except GetTimeoutError:
            raise WorkerStartupTimeoutError(
                f"ray_lightning: the worker actors did not {what} within {timeout_s:g} s "
                "(worker_start_timeout_s); a worker process may be stuck starting or importing."
            ) from None
        except RayActorError as error:
            rank = self._dead_rank(refs, actors)
            raise WorkerStartupError(
                f"A ray_lightning worker (rank {rank}) died while starting: {error}", rank=rank
            ) from error

    def _dead_rank(self, refs: list[Any], actors: list[int]) -> int:
        """The global rank of the first actor whose startup call failed."""
        dead = next((i for ref, i in zip(refs, actors) if ray.wait([ref], timeout=0)[0] and died(ref)), actors[0])
        return self.ranks[dead].global_rank

    def run(
        self,
        payload: ray.ObjectRef,
        contexts: list[WorkerContext],
        channel: DriverChannel | None = None,
        watchdog: Watchdog | None = None,
        stop: Callable[[], RayWorkerError | None] | None = None,
        keep_state: bool = False,
        collective_errors: tuple[type[BaseException], ...] = (),
    ) -> list[WorkerOutput | None]:
        """Run the call on every worker; their outputs in actor order, or the first failure raised.

        ``keep_state``: the workers keep the call's Trainer and process group until their next call (a fit's: the
        driver may have them save its checkpoint meanwhile, :mod:`.after_fit`) instead of cleaning up now.

        ``watchdog`` gets the ranks' progress reports from ``channel`` and stops a call whose rank is stuck;
        ``stop`` may end it after any message of the channel (:func:`~.poll.wait_for_outputs`). ``collective_errors``:
        what the strategy's collectives raise when a peer is gone (a rank's own exception is blamed before them).
        """
        self.calls += 1
        if channel is not None:
            channel.on_progress = watchdog.record if watchdog is not None else None
        refs = [actor.execute.remote([payload], ctx) for actor, ctx in zip(self.actors, contexts)]
        self._running, self._let_go = refs, set()
        ranks = [c.rank.global_rank for c in contexts]
        try:
            outputs = wait_for_outputs(refs, ranks, self.infos, channel, watchdog, stop, collective_errors)
        except WorkersGrowError:
            # Every rank leaves the call at its next batch; unless it had ended the fit meanwhile (no batch left).
            ended = self.interrupt(GROW_WAIT_S)
            if ended is None:
                raise
            outputs = ended
        self._running = []
        self.newcomers.stop()  # started for a grow the call did not live to make
        self.placement.release_unused()
        for actor in self.actors:
            # Clean up for the next call while the driver goes on; or, keeping the call's state, only wait at Ray's
            # niceness (the clean-up then runs when the next call starts).
            (actor.wait_idle if keep_state else actor.finish_call).remote()
        return outputs

    def shutdown(self) -> None:
        """Stop the actors and the channel, and give back an own placement group. Safe to call twice."""
        if not self.in_current_session():
            # Its Ray is gone, and the actors with it. Ray calls now would start a new local Ray.
            self.actors, self._channel = [], None
            return
        for ref in self._running:  # the errors of a failed call's other ranks: read, so Ray does not log them
            with contextlib.suppress(Exception):
                ray.get(ref, timeout=0)
        self._running = []
        self.drop_spares()
        self.newcomers.stop()
        for actor in self.actors:
            kill(actor)
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self.placement.release()
        self.actors = []


def _answer(ref: Any) -> bool:
    try:
        return bool(ray.get(ref, timeout=0))
    except Exception:  # noqa: BLE001 - a worker that cannot answer is replaced
        return False
