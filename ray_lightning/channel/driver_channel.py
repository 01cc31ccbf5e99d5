"""Calls from the workers to the process that called ``fit``, while training runs.

Some things can only happen in the driver: ``ray.tune.report`` works only in a Tune trial's own
process, which is the driver of the workers. A callback on rank 0 therefore sends
``(function, args)`` with :func:`send_to_driver`; the launcher runs ``function(*args)`` in the
driver as soon as it arrives (it waits on the channel and on the workers together, without
polling), in the order sent, and runs whatever is left before ``fit`` returns.

The channel is a :class:`ray.util.queue.Queue`, created only for Trainers with a callback that
sets ``needs_driver_channel = True`` or a progress bar (it costs an extra actor).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray
from pytorch_lightning.callbacks import TQDMProgressBar
from ray import cloudpickle
from ray.util.queue import Queue
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_lightning import runtime

if TYPE_CHECKING:
    import pytorch_lightning as pl

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


def needs_channel(trainer: pl.Trainer) -> bool:
    """Whether rank 0 will send calls to the driver: a callback asks for it (Tune reports), or the
    progress bar, which the driver draws."""
    return any(getattr(cb, "needs_driver_channel", False) for cb in trainer.callbacks) or isinstance(
        trainer.progress_bar_callback, TQDMProgressBar
    )


class DriverChannel:
    """The driver's end: a queue actor, and the one ``get`` in flight that the launcher waits on."""

    def __init__(self) -> None:
        # No CPU, and outside any placement group the driver runs in (a Tune trial's), so the
        # queue never takes a worker's reservation or waits for one.
        outside = PlacementGroupSchedulingStrategy(placement_group=None)
        self.queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": outside})
        self._pending: ray.ObjectRef | None = None

    def next_call(self) -> ray.ObjectRef:
        """A reference that becomes ready when a worker has sent the next call."""
        if self._pending is None:
            # Queue.get blocks the caller; the actor's own get returns a reference to wait on.
            self._pending = self.queue.actor.get.remote(None)
        return self._pending

    def run_next(self) -> None:
        """Run the call that :meth:`next_call` became ready with."""
        self._run(self._take())

    def run_remaining(self) -> None:
        """After the workers finished (their puts are done): run every call still queued."""
        self.queue.put(_END)
        while (item := self._take()) != _END:
            self._run(item)

    def _take(self) -> Any:
        ref, self._pending = self.next_call(), None
        return ray.get(ref)

    @staticmethod
    def _run(item: bytes) -> None:
        function, args = cloudpickle.loads(item)
        function(*args)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            ray.kill(self.queue.actor, no_restart=True)
