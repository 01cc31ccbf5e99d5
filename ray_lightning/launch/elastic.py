"""Where an elastic fit (``num_workers=(min, max)``) decides to grow: the driver's side of a resize.

A fit starts on as many workers as the cluster places at once (:func:`~.probes.reserve_elastic`, called by
the launcher's ``_acquire_group``); after a lost node its restart does the same, so it goes on with fewer
instead of waiting for a replacement. :class:`Growth` is the other way, and never restarts a process. Room comes
from two places: the fit's own bundles that Ray placed again after a lost node, and the cluster's free room, which a
probe (:func:`~.probes.free_room`, placement groups that take up to seconds to say no) looks for whenever a recovery
checkpoint of rank 0 has arrived and the last probe is ``grow_check_interval_s`` old, and reserves as a placement
group of the fit's own (:meth:`~.worker_group.WorkerGroup.extend`; while it waits to be grown into, no other probe
runs). The probe runs in a thread: the driver's loop goes on running rank 0's calls meanwhile (a synchronous 2 s
probe at every checkpoint once left the driver minutes behind the workers). Not after the last checkpoint of the fit:
nothing would be left to train.

A worker starts in each such bundle as soon as it is placed (:mod:`.standby`); the driver counts those up every
:data:`HELD_POLL_S` (it asks at least every second, :data:`~.poll.STOP_CHECK_S`, also while no worker sends anything).
Once they are up the attempt ends with :class:`~ray_lightning.errors.WorkersGrowError` (:mod:`.failures` keeps the
processes and does not count it against ``max_failures``): the launcher cancels the running call, every rank leaves it
at its next batch (:mod:`ray_lightning.home.snapshot`), and the group goes on in the same processes with the new workers
beside (:meth:`~.worker_group.WorkerGroup.salvage`): from memory where every rank holds the state (DDP, Horovod), else
(sharded) from the first recovery checkpoint that arrived once the new workers were up. A fit that goes on from a step's
checkpoint deals the rest of that epoch's data order over the new workers (:mod:`ray_lightning.data`, and a plain
``DataLoader``'s sampler). Growth law: while below ``max``, one read of Ray's placement-group table and node list per
second on the driver, and per grow one placement group of the workers added; nothing per byte.

On a cluster with an autoscaler, a fit running below ``max`` asks it for room for ``max`` workers
(``ray.autoscaler.sdk.request_resources``: a lost spot node is replaced even though nothing is pending), and
takes the request back when the call ends. Ray keeps one such request per cluster: two elastic fits at once
replace each other's (documented; a job's other requests would be replaced the same way).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from ray_lightning.config.elastic import ElasticSettings
from ray_lightning.config.resources import WorkerResources
from ray_lightning.errors import WorkersGrowError
from ray_lightning.home.recovery import PREEMPTION
from ray_lightning.launch.autoscaler import find_autoscaler
from ray_lightning.launch.placement import give_back
from ray_lightning.launch.probes import PROBE_S, free_room, placed_at_once

# How often a fit whose ranks hold its state asks about its own bundles placed again (a read of Ray's tables; the
# grow into them goes on from memory, so it waits for no checkpoint).
HELD_POLL_S = 1.0

log = logging.getLogger(__name__)


class Growth:
    """One call's growth checks. ``max_epochs``/``max_steps``: the Trainer's (None/-1: unbounded)."""

    def __init__(
        self, settings: ElasticSettings, request: WorkerResources, max_epochs: int | None, max_steps: int | None
    ) -> None:
        self.settings = settings
        self.request = request
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self._checked_at = float("-inf")
        self._held_at = float("-inf")
        self._seen: Any = None  # the checkpoint the last probe of the cluster was started at
        self._asked = False  # whether this call asked the autoscaler for room
        self._no_autoscaler = False
        # The probe of the cluster's free room running in its thread: (thread, the size it is for, its answer: the
        # placement group it reserved for the workers that fit, or None).
        self._probe: tuple[threading.Thread, int, list[Any]] | None = None
        self._reserved = False  # room reserved (``reserve``) that the fit has not grown into yet: no probe meanwhile
        self._closed = threading.Event()
        self._newest: tuple[Any, float] = (None, float("-inf"))  # the newest checkpoint and when it arrived
        # Workers started in the group's unused bundles: how many were up at the last poll, and since when.
        self._up, self._up_since = 0, float("inf")

    def attempt_started(self) -> None:
        """A new attempt of the call: room reserved in an earlier one is the group's or was released with it."""
        self._reserved, self._up, self._up_since = False, 0, float("inf")

    def ask_autoscaler(self, size: int) -> None:
        """Running on ``size`` workers: on a cluster with an autoscaler, ask it for room for the most (once)."""
        if size >= self.settings.max_workers or self._asked or self._no_autoscaler:
            return
        if find_autoscaler() is None:
            self._no_autoscaler = True  # looked up once per call: a cluster does not gain an autoscaler mid-fit
            return
        from ray.autoscaler.sdk import request_resources

        bundles, _ = self.request.with_workers(self.settings.max_workers).placement()
        request_resources(bundles=bundles)
        self._asked = True
        log.info("ray_lightning: asked the autoscaler for room for %d workers", self.settings.max_workers)

    def close(self) -> None:
        """After the call: wait for a probe still running (bounded: it removes its placement groups itself) and
        take back the autoscaler request, if this call made one."""
        self._closed.set()  # a probe still running gives back what it reserves
        self.wait_for_probe(PROBE_S * (math.ceil(math.log2(max(self.settings.max_workers, 2))) + 2))
        give_back(self._probe_answer()[1])  # found after the call ended: nothing holds it
        if self._asked:
            from ray.autoscaler.sdk import request_resources

            with contextlib.suppress(Exception):  # the cluster may be gone
                request_resources(bundles=[])
            self._asked = False

    def check(
        self,
        size: int,
        checkpoint: Any,
        spare: Callable[[], int],
        in_memory: bool,
        reserve: Callable[[Any], None],
    ) -> WorkersGrowError | None:
        """After a message from the workers: the error that ends the attempt to grow from ``size`` workers, or None.

        ``checkpoint``: the newest recovery checkpoint (with ``epoch``, ``global_step`` and ``reason``), or None.
        ``spare()``: the group's bundles placed but unused (its own, placed again after a lost node, and room reserved
        here) whose worker started there meanwhile is up (:mod:`.standby`). ``reserve(pg)``: room the probe of the
        cluster found and reserved (a placement group, placed) is handed to the group, whose workers then start there.
        Returns at once: the probe answers at a later message. Every grow keeps the running processes; ``in_memory``:
        every rank holds the fit's state (DDP, Horovod), so it grows at the next batch, from memory; else (sharded) from
        the first checkpoint that arrives once the new workers are up.
        """
        most, room, now = self.settings.max_workers - size, self._probed(size), time.monotonic()
        # No grow at the most workers, before a checkpoint, for a preemption's (the attempt stops for the notice; the
        # restart places what the cluster holds), nor after the last: a room found meanwhile is given back.
        if (
            most <= 0
            or checkpoint is None
            or checkpoint.reason.startswith(PREEMPTION)
            or self._nothing_left(checkpoint)
        ):
            give_back(room)
            return None
        if checkpoint is not self._newest[0]:
            self._newest = (checkpoint, now)
        if room is not None:
            reserve(room)  # its workers start at the poll below, beside the running ones
            self._held_at, self._reserved = float("-inf"), True
        if now - self._held_at >= HELD_POLL_S:
            self._held_at, self._up = now, min(spare(), most)  # a worker starts in each bundle, counted once up
            if self._up and self._up_since == float("inf"):
                log.info("ray_lightning: %d new worker(s) up beside the %d running; the fit grows to %d at the next %s",
                         self._up, size, size + self._up, "batch" if in_memory else "recovery checkpoint")  # fmt: skip
            self._up_since = min(self._up_since, now) if self._up else float("inf")
        # In memory, at the next batch; sharded, from the first checkpoint that arrived once they were up (the fit
        # trains on meanwhile), so that little is trained again.
        if self._up and (in_memory or self._newest[1] >= self._up_since):
            error = self._error(size, self._up, checkpoint, in_memory)
            self.attempt_started()  # the next attempt counts its own newcomers
            return error
        due = now - self._checked_at >= self.settings.grow_check_interval_s
        if checkpoint is not self._seen and self._probe is None and due and not self._reserved:
            self._seen, self._checked_at = checkpoint, now
            self._start_probe(size, most)
        return None

    def _error(self, size: int, extra: int, checkpoint: Any, in_memory: bool) -> WorkersGrowError:
        if in_memory:
            where = "the running workers' next step, with new ones beside them"
        else:
            where = f"the recovery checkpoint at epoch {checkpoint.epoch}, step {checkpoint.global_step}"
            where += ", in the running workers with new ones beside them"
        return WorkersGrowError(
            f"ray_lightning: the cluster can hold {size + extra} workers now (num_workers=({self.settings.min_workers},"
            f" {self.settings.max_workers}), {size} running); the fit goes on from {where}, on {size + extra}.",
            size + extra,
        )

    def _start_probe(self, size: int, most: int) -> None:
        """Ask for the cluster's free room in a thread, and reserve what it found (a placement group)."""
        answer: list[Any] = []

        def probe() -> None:
            room = None
            try:
                extra = free_room(self.request, most)
                # Another job may take the room between the probe and the reservation: then there is none.
                room = placed_at_once(self.request.with_workers(extra)) if extra else None
            except Exception as error:  # noqa: BLE001 - a probe that fails finds no room; the next check asks again
                log.warning("ray_lightning: asking the cluster for room to grow failed: %r", error)
            if self._closed.is_set():  # the call ended meanwhile
                give_back(room)
                room = None
            answer.append(room)

        thread = threading.Thread(target=probe, name="ray_lightning-grow-probe", daemon=True)
        self._probe = (thread, size, answer)
        thread.start()

    def _probed(self, size: int) -> Any:
        """The room (a placement group, placed) reserved by a probe that has finished (taken once) for a group of
        ``size`` workers, or None."""
        if self._probe is None or self._probe[0].is_alive():
            return None
        probed_for, room = self._probe_answer()
        if probed_for != size:  # for another size: room for the wrong number of workers
            give_back(room)
            return None
        return room

    def _probe_answer(self) -> tuple[int, Any]:
        """(the size it was for, the room it reserved or None) of the finished probe, taken."""
        probe, self._probe = self._probe, None
        if probe is None or probe[0].is_alive() or not probe[2]:
            return 0, None
        return probe[1], probe[2][0]

    def wait_for_probe(self, timeout_s: float) -> None:
        """Until a running probe of the cluster's free room has answered (at most ``timeout_s``)."""
        if self._probe is not None:
            self._probe[0].join(timeout_s)

    def _nothing_left(self, checkpoint: Any) -> bool:
        # An epoch's checkpoint names the epoch after it; a step's, the epoch it is in.
        if self.max_epochs is not None and 0 <= self.max_epochs <= checkpoint.epoch:
            return True
        return self.max_steps is not None and 0 <= self.max_steps <= checkpoint.global_step
