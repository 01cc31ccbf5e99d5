"""Calls from the workers to the process that called ``fit``, while training runs.

Some things can only happen in the driver: ``ray.tune.report`` works only in a Tune trial's own
process, which is the driver of the workers. A callback on rank 0 therefore sends
``(function, args)`` with :func:`send_to_driver`; the launcher runs ``function(*args)`` in the
driver as soon as it arrives (it waits on the channel and on the workers together, without
polling), in the order sent, and runs whatever is left before ``fit`` returns.

The channel is a :class:`ray.util.queue.Queue` (an extra actor, kept with the worker group). It
also carries each rank's progress reports (:mod:`.heartbeat`) to the launcher's watchdog, and rank 0's
recovery checkpoints (:func:`send_object_to_driver`) to the launcher's recovery.

:func:`ask_driver` waits for the driver's answer (a Tune trial's report: whether Tune lets the trial
go on). The answer comes back through Ray's internal key-value store under a key made for that one
question: the workers' actors run one call at a time, so the driver cannot call into rank 0 while it
trains, and a second queue actor per call would cost a process start for every group.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray
from ray import cloudpickle
from ray.util.queue import Queue
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from ray_lightning import runtime
from ray_lightning._ray.kv import kv_delete, kv_get, kv_put
from ray_lightning.channel.heartbeat import ProgressReport

_END = "ray_lightning: end of driver calls"
_OBJECT = "ray_lightning.object"
_ANSWERS = "ray_lightning_answers"  # the key-value namespace of ask_driver's answers
# How long rank 0 waits for the driver's answer by default (a Tune report waits for Tune's controller).
ANSWER_TIMEOUT_S = 300.0
_ANSWER_POLL_S = 0.005


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


def ask_driver(function: Callable[..., Any], *args: Any, timeout_s: float = ANSWER_TIMEOUT_S) -> Any:
    """Run ``function(*args)`` in the driver, in order with :func:`send_to_driver`'s calls, and return its result.

    A ``function`` that raises fails the call on the driver (as with :func:`send_to_driver`); here it raises
    a ``RuntimeError`` naming it. Waiting longer than ``timeout_s`` raises ``TimeoutError``.
    """
    context = runtime.current_context()
    queue = context.driver_queue if context is not None else None
    if queue is None:
        return function(*args)
    key = f"answer-{uuid.uuid4().hex}"
    queue.put(cloudpickle.dumps((function, args, key)))
    deadline = time.monotonic() + timeout_s
    while (raw := kv_get(key, namespace=_ANSWERS)) is None:
        if time.monotonic() > deadline:
            name = getattr(function, "__qualname__", repr(function))
            raise TimeoutError(f"rank 0 waited {timeout_s:g} s for the driver to answer {name}(...); it did not.")
        time.sleep(_ANSWER_POLL_S)
    kv_delete(key, namespace=_ANSWERS)
    ok, value = cloudpickle.loads(raw)
    if not ok:
        raise RuntimeError(f"the driver failed to run {getattr(function, '__qualname__', function)}: {value}")
    return value


def send_object_to_driver(header: Any, value: Any) -> None:
    """Hand ``value`` to the driver through the object store; ``header`` (small, plain data) says what it is.

    The reference travels inside the queue's message, so Ray counts the driver's borrow: the value
    stays readable until the driver has taken it (or this process dies; the driver then keeps what
    it had). Only the reference passes through the queue actor, never the bytes. The driver's
    ``DriverChannel.on_object`` receives ``(header, ref)``.
    """
    context = runtime.current_context()
    if context is None or context.driver_queue is None:
        raise RuntimeError("send_object_to_driver is called in a ray_lightning worker during a call.")
    # A blocking put: the queue holds its borrow of the reference before this process lets go of it.
    context.driver_queue.put((_OBJECT, cloudpickle.dumps(header), [ray.put(value)]))


class DriverChannel:
    """The driver's end: a queue actor, and the one ``get`` in flight that the launcher waits on."""

    def __init__(self, node_id: str | None = None) -> None:
        # No CPU, and outside any placement group the driver runs in (a Tune trial's), so the
        # queue never takes a worker's reservation or waits for one. On the driver's node when it
        # is one (``node_id``): the queue then outlives any worker's node, and with it the call.
        where: Any = PlacementGroupSchedulingStrategy(placement_group=None)
        if node_id is not None:
            where = NodeAffinitySchedulingStrategy(node_id, soft=False)
        self.queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": where})
        self._pending: ray.ObjectRef | None = None
        # Where the ranks' progress reports go (the launcher's watchdog); dropped when None.
        self.on_progress: Callable[[ProgressReport], None] | None = None
        # Where objects sent with send_object_to_driver go: (header, reference); dropped when None.
        self.on_object: Callable[[Any, ray.ObjectRef], None] | None = None

    def next_call(self) -> ray.ObjectRef:
        """A reference that becomes ready when a worker has sent the next call."""
        if self._pending is None:
            # Queue.get blocks the caller; the actor's own get returns a reference to wait on.
            self._pending = self.queue.actor.get.remote(None)
        return self._pending

    def run_next(self) -> None:
        """Run the call (or record the progress report) that :meth:`next_call` became ready with."""
        self._run(self._take())

    def run_remaining(self, timeout_s: float | None = None) -> None:
        """After the workers finished (their puts are done): run every call still queued.

        ``timeout_s`` bounds each wait for the queue (after a failure, its node may be gone).
        """
        ray.get(self.queue.actor.put.remote(_END, None), timeout=timeout_s)
        while (item := self._take(timeout_s)) != _END:
            self._run(item)

    def _take(self, timeout_s: float | None = None) -> Any:
        ref, self._pending = self.next_call(), None
        return ray.get(ref, timeout=timeout_s)

    def _run(self, item: Any) -> None:
        report = ProgressReport.from_message(item)
        if report is not None:
            if self.on_progress is not None:
                self.on_progress(report)
            return
        if isinstance(item, tuple) and len(item) == 3 and item[0] == _OBJECT:
            if self.on_object is not None:
                self.on_object(cloudpickle.loads(item[1]), item[2][0])
            return
        function, args, *answer_key = cloudpickle.loads(item)
        if not answer_key:
            function(*args)
            return
        try:
            result = function(*args)
        except BaseException as error:
            # The asking rank learns of it at once; the error itself fails the call here.
            kv_put(answer_key[0], cloudpickle.dumps((False, f"{type(error).__name__}: {error}")), namespace=_ANSWERS)
            raise
        kv_put(answer_key[0], cloudpickle.dumps((True, result)), namespace=_ANSWERS)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            ray.kill(self.queue.actor, no_restart=True)
