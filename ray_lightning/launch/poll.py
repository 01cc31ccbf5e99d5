"""Waiting for a call's workers: without polling, running the driver calls rank 0 sends, blaming the right rank.

:func:`wait_for_outputs` blocks in ``ray.wait`` until some worker finishes or fails, the driver
channel has a call or progress report (:mod:`ray_lightning.channel`), or the watchdog's next bound
passes (:mod:`.watchdog`: a stuck rank is raised with every rank's stack). The
first failure is raised as a :class:`~ray_lightning.errors.RayWorkerError` naming the rank, its node
and pid, with the worker's traceback. When a worker dies or its code raises, its peers' collectives fail
at about the same moment (a rank that raised leaves its process group at once), and whichever error
reaches the driver first is luck: so within ``DEATH_GRACE_S`` of an exception, a death found is blamed
instead, and an exception that is not a broken collective is blamed before one that is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from ray_lightning.errors import RayWorkerError, WorkerDiedError
from ray_lightning.home.results import WorkerOutput
from ray_lightning.launch.failures import caused_by_peer_loss
from ray_lightning.launch.stacks import collect_stacks
from ray_lightning.launch.watchdog import Watchdog

if TYPE_CHECKING:
    from ray_lightning.channel.driver_channel import DriverChannel
    from ray_lightning.launch.actor import NodeInfo

# How long to look for a dead worker behind another worker's exception (its peers fail at once too).
DEATH_GRACE_S = 2.0
# ``stop`` is asked at least this often, also while no worker sends anything (a rank inside a long step).
STOP_CHECK_S = 1.0


def wait_for_outputs(
    refs: Sequence[ray.ObjectRef],
    ranks: Sequence[int],
    infos: Sequence[NodeInfo],
    channel: DriverChannel | None,
    watchdog: Watchdog | None = None,
    stop: Callable[[], RayWorkerError | None] | None = None,
    collective_errors: tuple[type[BaseException], ...] = (),
) -> list[WorkerOutput | None]:
    """Every worker's output in actor order, or the first failure raised with its rank.

    ``ranks[i]`` and ``infos[i]`` are actor ``i``'s global rank and location. Calls the workers
    send through ``channel`` run here as they arrive, and their progress goes to ``watchdog``,
    which raises when a rank stays in one place for longer than its bound. After each message of the
    channel, and at least every :data:`STOP_CHECK_S`, ``stop`` may give an error that ends the wait (a preemption
    rank 0 checkpointed for, an elastic fit's growth).
    ``collective_errors``: what the strategy's collectives raise when a peer is gone, besides torch's.
    """
    pending = {ref: i for i, ref in enumerate(refs)}
    outputs: list[WorkerOutput | None] = [None] * len(refs)
    while pending:
        waiting = list(pending) if channel is None else [*pending, channel.next_call()]
        timeout = watchdog.seconds_left() if watchdog else None
        if stop is not None:
            timeout = STOP_CHECK_S if timeout is None else min(timeout, STOP_CHECK_S)
        done, _ = ray.wait(waiting, num_returns=1, timeout=timeout)
        if not done:
            _check(watchdog, infos)
            if stop is not None and (error := stop()) is not None:
                raise error
            continue
        if channel is not None and channel.next_call() in done:
            _run_driver_call(channel)
            error = stop() if stop is not None else None
            if error is not None:
                raise error
            continue
        for ref in done:
            i = pending.pop(ref)
            if watchdog is not None:
                watchdog.finished(ranks[i])
            try:
                outputs[i] = ray.get(ref)
            except RayActorError as error:
                raise worker_failure(ranks[i], _info(infos, i), error, died=True) from None
            except RayTaskError as error:
                i, error = _root_cause(i, error, pending, ranks, infos, collective_errors)
                raise worker_failure(ranks[i], _info(infos, i), error, died=False) from _cause(error)
    return outputs


def _run_driver_call(channel: DriverChannel) -> None:
    try:
        channel.run_next()
    except RayActorError as error:
        # The queue actor lives on the driver's node; under Ray Client, on some node of the cluster.
        raise WorkerDiedError(
            f"ray_lightning's channel from the workers to this process (a queue actor) died, with its node: {error}. "
            "All workers have been stopped.",
            rank=-1,
        ) from None


def _check(watchdog: Watchdog | None, infos: Sequence[NodeInfo]) -> None:
    """Raise the watchdog's error, with every worker's stack, if some rank is past its bound."""
    overdue = watchdog.overdue() if watchdog is not None else []
    if overdue:
        raise watchdog.hang_error(overdue, collect_stacks([(i.node_id, i.pid) for i in infos]))


def _root_cause(
    i: int,
    error: RayTaskError,
    pending: dict[Any, int],
    ranks: Sequence[int],
    infos: Sequence[NodeInfo],
    collective_errors: tuple[type[BaseException], ...],
) -> tuple[int, RayTaskError]:
    """Actor ``i``'s exception, or the one behind it: waits at most ``DEATH_GRACE_S`` for the other workers,
    raises the death of one that died, and prefers an exception that is not a broken collective."""
    done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=DEATH_GRACE_S)
    raised: list[tuple[int, RayTaskError]] = []
    for ref in done:
        try:
            ray.get(ref)
        except RayActorError as death:
            j = pending[ref]
            raise worker_failure(ranks[j], _info(infos, j), death, died=True) from None
        except RayTaskError as other:
            raised.append((pending[ref], other))
        except Exception:  # noqa: BLE001 - only deaths and exceptions matter here
            pass
    if caused_by_peer_loss(_cause(error), collective_errors):
        for j, other in raised:
            if not caused_by_peer_loss(_cause(other), collective_errors):
                return j, other
    return i, error


def _info(infos: Sequence[NodeInfo], i: int) -> NodeInfo | None:
    return infos[i] if i < len(infos) else None


def worker_failure(rank: int, info: NodeInfo | None, error: Exception, died: bool) -> RayWorkerError:
    """The error the driver raises for a worker that raised (``died=False``) or died."""
    where = f"node {info.node_ip}, pid {info.pid}" if info else "unknown node"
    if died:
        message = (
            f"ray_lightning worker rank {rank} ({where}) died unexpectedly (killed, out of memory, or "
            f"its node failed): {error}. All workers have been stopped."
        )
        # Ray says so when the node was drained for preemption (a spot instance taken back).
        return WorkerDiedError(message, rank=rank, preempted=bool(getattr(error, "preempted", False)))
    trace = getattr(error, "traceback_str", None) or str(error)
    message = f"ray_lightning worker rank {rank} ({where}) raised an exception. All workers have been stopped.\n{trace}"
    return RayWorkerError(message, rank=rank)


def _cause(error: RayTaskError) -> BaseException | None:
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else None
