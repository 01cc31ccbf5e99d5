"""Calls from the workers to the process that called ``fit``, while training runs.

Some things can only happen in the driver: ``ray.tune.report`` works only in a Tune trial's own
process, which is the driver of the workers. A callback on rank 0 therefore sends
``(function, args)`` with :func:`send_to_driver`; the launcher runs ``function(*args)`` in the
driver as soon as it arrives (it waits on the channel and on the workers together, without
polling), in the order sent, and runs whatever is left before ``fit`` returns.

The channel is a :class:`ray.util.queue.Queue` (an extra actor, kept with the worker group). It
also carries each rank's progress reports (:mod:`.heartbeat`) to the launcher's watchdog.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import ray
from ray import cloudpickle
from ray.util.queue import Queue
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_lightning import runtime
from ray_lightning.channel.heartbeat import ProgressReport

_END = "ray_lightning: end of driver calls"


def send_to_driver(function: Callable[..., Any], *args: Any) -> None:
    """Run ``function(*args)`` in the driver; called directly when already there.

    ``function`` must be importable by name (a module-level function) or picklable.
    """
    context = runtime.current_context()
    queue = context.driver_queue if context is not None else None
    if queue is None:
        function(*args)
    else:
        # Pickled here: the queue actor then holds bytes and never imports what the call needs.
        queue.put(cloudpickle.dumps((function, args)))


class DriverChannel:
    """The driver's end: a queue actor, and the one ``get`` in flight that the launcher waits on."""

    def __init__(self) -> None:
        # No CPU, and outside any placement group the driver runs in (a Tune trial's), so the
        # queue never takes a worker's reservation or waits for one.
        outside = PlacementGroupSchedulingStrategy(placement_group=None)
        self.queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": outside})
        self._pending: ray.ObjectRef | None = None
        # Where the ranks' progress reports go (the launcher's watchdog); dropped when None.
        self.on_progress: Callable[[ProgressReport], None] | None = None

    def next_call(self) -> ray.ObjectRef:
        """A reference that becomes ready when a worker has sent the next call."""
        if self._pending is None:
            # Queue.get blocks the caller; the actor's own get returns a reference to wait on.
            self._pending = self.queue.actor.get.remote(None)
        return self._pending

    def run_next(self) -> None:
        """Run the call (or record the progress report) that :meth:`next_call` became ready with."""
        self._run(self._take())

    def run_remaining(self) -> None:
        """After the workers finished (their puts are done): run every call still queued."""
        self.queue.put(_END)
        while (item := self._take()) != _END:
            self._run(item)

    def _take(self) -> Any:
        ref, self._pending = self.next_call(), None
        return ray.get(ref)

    def _run(self, item: Any) -> None:
        report = ProgressReport.from_message(item)
        if report is not None:
            if self.on_progress is not None:
                self.on_progress(report)
            return
        function, args = cloudpickle.loads(item)
        function(*args)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            ray.kill(self.queue.actor, no_restart=True)
