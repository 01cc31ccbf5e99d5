"""Where an elastic fit (``num_workers=(min, max)``) decides to grow: the driver's side of a resize.

A fit starts on as many workers as the cluster places at once (:func:`~.probes.reserve_elastic`, called by
the launcher's ``_acquire_group``); after a lost node its restart does the same, so it goes on with fewer
instead of waiting for a replacement. :class:`Growth` is the other way: whenever a recovery checkpoint of rank 0
has arrived (an epoch's end, or every ``recovery_checkpoint_every_n_steps`` steps) and the last check is
``grow_check_interval_s`` old, it asks whether more workers fit now: first the fit's own bundles that Ray placed again
after a lost node (read at once), else the cluster's free room (:func:`~.probes.free_room`, placement groups that
take up to seconds to say no). That probe runs in a thread of its own: the driver's loop goes on running rank 0's
calls meanwhile (a synchronous 2 s probe at every checkpoint once left the driver minutes behind the workers, and
decided on a checkpoint 700 steps old). When room is found, the attempt ends with
:class:`~ray_lightning.errors.WorkersGrowError` and the fit restarts from the newest checkpoint on
more workers (:mod:`.failures` restarts it without counting it against ``max_failures``). A step's checkpoint cuts
its epoch in two: the rest of the epoch's data order is dealt over the new workers (:mod:`ray_lightning.data`, and
a plain ``DataLoader``'s sampler), as after a lost node. Not after the last checkpoint of the fit: nothing would be
left to train.

A fit whose ranks each hold its state (DDP, Horovod) grows into its own bundles placed again without a checkpoint
and without restarting a process: it asks about them every :data:`HELD_POLL_S` (the driver asks at least every
second, :data:`~.poll.STOP_CHECK_S`, also while no worker sends anything), a worker starts in each as soon as one is
placed (:mod:`.standby`), and once those are up the attempt ends with ``into_held``: the launcher cancels the running
call, every rank leaves it at its next batch with its state (:mod:`ray_lightning.home.snapshot`), and the group goes
on from that memory with the new workers beside (:meth:`~.worker_group.WorkerGroup.salvage`). Growth law: while
below ``max``, one read of Ray's placement-group table and node list per second on the driver; nothing per byte.

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
from ray_lightning.launch.probes import PROBE_S, free_room

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
        self._seen: Any = None
        self._asked = False  # whether this call asked the autoscaler for room
        self._no_autoscaler = False
        # The probe of the cluster's free room running in its thread: (thread, the size it is for, its answer).
        self._probe: tuple[threading.Thread, int, list[int]] | None = None

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
        self.wait_for_probe(PROBE_S * (math.ceil(math.log2(max(self.settings.max_workers, 2))) + 2))
        self._probe = None
        if self._asked:
            from ray.autoscaler.sdk import request_resources

            with contextlib.suppress(Exception):  # the cluster may be gone
                request_resources(bundles=[])
            self._asked = False

    def check(
        self, size: int, checkpoint: Any, spare: Callable[[], int] = lambda: 0, in_memory: bool = False
    ) -> WorkersGrowError | None:
        """After a message from the workers: the error that ends the attempt to grow from ``size`` workers, or None.

        ``checkpoint``: the newest recovery checkpoint (with ``epoch``, ``global_step`` and ``reason``), or None.
        ``spare``: bundles the running group holds placed but unused (after a lost node, placed again by Ray),
        room that a probe for a new placement group cannot see. Returns at once: a probe of the cluster's free
        room answers at a later message. ``in_memory``: every rank holds the fit's state (DDP, Horovod); a grow into
        ``spare`` bundles alone then keeps the running processes (:attr:`WorkersGrowError.into_held`), and ``spare``
        counts a bundle once the worker started in it meanwhile is up (:mod:`.standby`).
        """
        most = self.settings.max_workers - size
        if most <= 0 or checkpoint is None:
            return None
        if checkpoint.reason.startswith(PREEMPTION):
            return None  # the attempt stops for the notice; the restart after it places what the cluster holds
        if self._nothing_left(checkpoint):
            return None
        extra, held, now = self._probed(size), 0, time.monotonic()
        if not extra and in_memory and now - self._held_at >= HELD_POLL_S:
            self._held_at = now
            held = extra = min(spare(), most)  # a worker starts in each, counted once it is up (.standby)
        due = now - self._checked_at >= self.settings.grow_check_interval_s
        if not extra and checkpoint is not self._seen and self._probe is None and due:
            self._seen, self._checked_at = checkpoint, now
            held = 0 if in_memory else min(spare(), most)
            if held:  # room now: the rest is asked for here, as the restart follows anyway
                extra = held + free_room(self.request, most - held)
            else:
                self._start_probe(size, most)
        if not extra:
            return None
        into_held = in_memory and 0 < held == extra
        where = (
            "the running workers' next step, with new ones beside them"
            if into_held
            else f"the recovery checkpoint at epoch {checkpoint.epoch}, step {checkpoint.global_step}"
        )
        return WorkersGrowError(
            f"ray_lightning: the cluster can hold {size + extra} workers now (num_workers=({self.settings.min_workers},"
            f" {self.settings.max_workers}), {size} running); the fit goes on from {where}, on {size + extra}.",
            size + extra,
            into_held,
        )

    def _start_probe(self, size: int, most: int) -> None:
        answer: list[int] = []

        def probe() -> None:
            try:
                answer.append(free_room(self.request, most))
            except Exception as error:  # noqa: BLE001 - a probe that fails finds no room; the next check asks again
                log.warning("ray_lightning: asking the cluster for room to grow failed: %r", error)
                answer.append(0)

        thread = threading.Thread(target=probe, name="ray_lightning-grow-probe", daemon=True)
        self._probe = (thread, size, answer)
        thread.start()

    def _probed(self, size: int) -> int:
        """The answer of a probe that has finished (taken once), for a group of ``size`` workers; else 0."""
        if self._probe is None or self._probe[0].is_alive():
            return 0
        _, probed_for, answer = self._probe
        self._probe = None
        return answer[0] if answer and probed_for == size else 0

    def wait_for_probe(self, timeout_s: float) -> None:
        """Until a running probe of the cluster's free room has answered (at most ``timeout_s``)."""
        if self._probe is not None:
            self._probe[0].join(timeout_s)

    def _nothing_left(self, checkpoint: Any) -> bool:
        # An epoch's checkpoint names the epoch after it; a step's, the epoch it is in.
        if self.max_epochs is not None and 0 <= self.max_epochs <= checkpoint.epoch:
            return True
        return self.max_steps is not None and 0 <= self.max_steps <= checkpoint.global_step
