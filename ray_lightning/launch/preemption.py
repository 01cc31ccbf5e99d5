"""A worker whose process or node is about to go away gets rank 0 to checkpoint first.

Ray sends no signal to the processes of a node it drains (``ray drain-node``, a cloud's preemption
notice passed on by the autoscaler, SIGTERM to the node's ``ray start``, which drains it with a
30 s deadline): it marks the node draining with a deadline, schedules nothing new there, and
leaves the killing to whoever drained it. So rank 0 watches: every :data:`POLL_S` a thread of
its own reads which nodes are draining (the GCS, as Ray Train's own preemption watcher does) and
whether a worker left a notice. A worker that itself receives SIGTERM (a container stopped, a
process killed politely) leaves a notice under the call's key in Ray's key-value store, or, on
rank 0, asks directly; it keeps training for up to :data:`SIGTERM_GRACE_S` so that rank 0 can
checkpoint (the driver then restarts the workers elsewhere), and exits after that as asked. The
GCS's draining nodes and the key-value store are Ray's private APIs (:mod:`ray_lightning._ray`).

Rank 0's recovery callback (:mod:`ray_lightning.home.recovery`) takes the checkpoint at the next
batch end (:func:`ray_lightning.runtime.request_checkpoint`). Only a fit that may restart
(``max_failures > 0``) watches.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from typing import Any

import ray
from typing_extensions import override

from ray_lightning import namespaces, runtime
from ray_lightning._ray import kv
from ray_lightning._ray import state as ray_state
from ray_lightning.runtime import RecoveryPlan

log = logging.getLogger(__name__)

POLL_S = 1.0
SIGTERM_GRACE_S = 30.0
_NAMESPACE = "ray_lightning"


def draining_nodes() -> dict[str, int]:
    """``{node id: drain deadline in ms since the epoch (0: none)}`` of the cluster's draining nodes."""
    return ray_state.draining_nodes()  # no public API tells yet; Ray Train polls the same


def leave_notice(key: str, reason: str) -> None:
    """Tell rank 0's watcher (any node) that ``reason``: a worker is going away."""
    kv.kv_put(key, reason.encode(), namespace=_NAMESPACE)


def read_notice(key: str) -> str | None:
    value = kv.kv_get(key, namespace=_NAMESPACE)
    return value.decode(errors="replace") if value else None


def forget_notice(key: str) -> None:
    """On the driver after a call: the key is the call's alone."""
    with contextlib.suppress(Exception):
        kv.kv_delete(key, namespace=_NAMESPACE)


class PreemptionWatch:
    """This worker's part for one call: the SIGTERM handler, and on rank 0 of a fit that may restart
    the watching thread.

    Without a recovery ``plan`` (``max_failures=0``), SIGTERM ends the worker at once, as Ray's own
    handler does, so the driver reports the rank: Lightning's handler, which the Trainer installs
    for the call, would instead wait in a collective for ranks that never got the signal.
    """

    def __init__(self, plan: RecoveryPlan | None, rank: int, where: str) -> None:
        self._plan = plan
        self._rank = rank
        self._where = where  # "node 10.0.0.5, pid 4711", for the reason rank 0 gives
        self._previous: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: set[str] = set()
        self._grace_over = False

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        if self._rank == 0 and self._plan is not None:
            self._thread = threading.Thread(target=self._watch, name="ray_lightning-preemption", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def install(self) -> None:
        """Put this handler back in front (the Trainer installs its own as a loop starts); main thread only."""
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._grace_over or self._plan is None:
            self._leave(signum, frame)
            return
        reason = f"rank {self._rank} ({self._where}) received SIGTERM"
        log.warning("ray_lightning: %s; asking rank 0 for a checkpoint before it goes", reason)
        if self._rank == 0:
            runtime.request_checkpoint(reason)
        else:
            # A key-value store call is a network call: not in a signal handler.
            threading.Thread(target=leave_notice, args=(self._plan.notice_key, reason), daemon=True).start()
        timer = threading.Timer(SIGTERM_GRACE_S, self._end_grace)
        timer.daemon = True
        timer.start()

    def _end_grace(self) -> None:
        # Handlers can only be swapped on the main thread: signal it again, and let it leave.
        self._grace_over = True
        os.kill(os.getpid(), signal.SIGTERM)

    def _leave(self, signum: int, frame: Any) -> None:
        """After the grace period, on the main thread: go away as SIGTERM asked (Ray's handler, or the default)."""
        previous, self._previous = self._previous, None
        if callable(previous):
            signal.signal(signal.SIGTERM, previous)
            previous(signum, frame)
            return
        if previous == signal.SIG_IGN:
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self._check()
            except Exception:  # a GCS hiccup (logged); the next poll tries again
                log.debug("ray_lightning: preemption check failed", exc_info=True)

    def _check(self) -> None:
        draining = draining_nodes()
        for node in self._plan.node_ids:
            if node in draining and node not in self._seen:
                self._seen.add(node)
                deadline = draining[node]
                left = f", {max(0.0, deadline / 1000 - time.time()):.0f} s before its deadline" if deadline else ""
                runtime.request_checkpoint(f"node {node[:8]} of this fit's workers is being drained{left}")
        notice = read_notice(self._plan.notice_key)
        if notice and notice not in self._seen:
            self._seen.add(notice)
            runtime.request_checkpoint(notice)


class SigtermFirst(*namespaces.every("callbacks.Callback")):
    """Puts the watch's SIGTERM handler back in front of the Trainer's as each loop starts.

    Lightning installs its SIGTERM handler for the call just before the loop runs; in 2.6 it
    broadcasts from the rank that got the signal, a collective the other ranks never join.
    """

    def __init__(self, watch: PreemptionWatch) -> None:
        self._watch = watch

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._watch.install()

    @override
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._watch.install()

    @override
    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._watch.install()

    @override
    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._watch.install()


def where_this_runs() -> str:
    return f"node {ray.util.get_node_ip_address()}, pid {os.getpid()}"
