"""Workers kept alive between calls, so the next ``fit`` in the same process starts at once.

Starting a worker means a new process that imports torch and Lightning: seconds, on every call.
After a call that succeeded, the launcher hands its worker group here instead of stopping it; the
next call with the same resource request takes it back (after each actor confirms that no code it
imported has changed) and skips placement, process start and imports.

Decisions:
- At most one group waits, the last one; a call asking for other resources stops it first, since
  it holds resources the new call may need.
- A waiting group holds its reservation (CPUs, GPUs) for ``keep_workers_alive_s`` (default 60 s),
  then is stopped; ``keep_workers_alive_s=0`` stops workers after every call, as before.
- Groups started inside someone else's placement group (a Tune trial's) are kept for the next call
  inside that same placement group only: Tune hands a reused trial actor (``reuse_actors=True``)
  the same reservation, so the next trial's ``fit`` starts on the same processes. When Tune ends
  the trial's actor instead, the workers end with it (Ray ends actors with their owner).
- A failed call stops its workers: a process that failed may be in any state.
- :func:`release_idle_workers` stops a waiting group now.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import ray

if TYPE_CHECKING:
    from ray_lightning.config.resources import WorkerResources
    from ray_lightning.launch.worker_group import WorkerGroup

# How long a kept worker may take to say whether it can run another call before a fresh one replaces it.
REUSE_CHECK_TIMEOUT_S = 30.0

_lock = threading.Lock()
# (what the group was asked for: the request and the placement group it was started inside, if any; it; its timer)
_idle: tuple[tuple[WorkerResources, Any], WorkerGroup, threading.Timer] | None = None


def keep(request: WorkerResources, group: WorkerGroup, seconds: float, within: Any = None) -> None:
    """Keep ``group`` for the next call asking for ``request`` (inside placement group ``within``, if one);
    stop it after ``seconds`` unused."""
    _keep((request, _group_id(within)), group, seconds)


def _keep(kept_for: tuple[Any, Any], group: WorkerGroup, seconds: float) -> None:
    global _idle
    timer = threading.Timer(seconds, _expire, args=(group,))
    timer.daemon = True
    timer.seconds = seconds  # type: ignore[attr-defined] - how long it waits again after a borrow
    with _lock:
        replaced, _idle = _idle, (kept_for, group, timer)
    _stop(replaced)
    timer.start()


@contextlib.contextmanager
def borrowed(group: WorkerGroup) -> Iterator[bool]:
    """``group`` out of the pool while the caller uses it (it cannot expire meanwhile), then back for the next call
    with its full wait again; yields False when ``group`` no longer waits (taken, replaced or expired)."""
    global _idle
    with _lock:
        waiting = _idle if _idle is not None and _idle[1] is group else None
        if waiting is not None:
            _idle = None
    if waiting is None:
        yield False
        return
    kept_for, _, timer = waiting
    timer.cancel()
    try:
        yield True
    except BaseException:
        group.shutdown()  # a worker that failed may be in any state: no later call runs on it
        raise
    _keep(kept_for, group, timer.seconds)


def take(request: WorkerResources, within: Any = None) -> WorkerGroup | None:
    """The waiting group if it matches ``request`` (and was started inside ``within``) and can run another
    call; else None (and none waits)."""
    global _idle
    with _lock:
        waiting, _idle = _idle, None
    if waiting is None:
        return None
    kept_for, group, timer = waiting
    timer.cancel()
    try:
        usable = kept_for == (request, _group_id(within)) and _still_usable(group)
    except BaseException:  # Ctrl-C while asking: the group is no one's now
        group.shutdown()
        raise
    if not usable:
        group.shutdown()
        return None
    return group


def release_idle_workers() -> None:
    """Stop the workers kept alive after the last ``fit``/``test``/... of this process, if any.

    Example::

        trainer.fit(model)                          # workers stay for the next call...
        ray_lightning.release_idle_workers()        # ...unless you free their resources now
    """
    global _idle
    with _lock:
        waiting, _idle = _idle, None
    _stop(waiting)


def _group_id(pg: Any) -> Any:
    return None if pg is None else pg.id


def _stop(waiting: tuple[Any, WorkerGroup, threading.Timer] | None) -> None:
    if waiting is not None:
        waiting[2].cancel()
        waiting[1].shutdown()


def _expire(group: WorkerGroup) -> None:
    global _idle
    with _lock:
        if _idle is None or _idle[1] is not group:
            return  # taken or replaced meanwhile
        _idle = None
    with contextlib.suppress(Exception):
        group.shutdown()


def _still_usable(group: WorkerGroup) -> bool:
    """Every actor is alive, in this Ray session, and has no changed code."""
    if not group.in_current_session():
        return False
    try:
        refs: list[Any] = [actor.reusable.remote() for actor in group.actors]
        return all(ray.get(refs, timeout=REUSE_CHECK_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - a dead actor, a timeout: start afresh
        return False
