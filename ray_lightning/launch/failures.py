"""Where a restart is decided: what kind of failure ended an attempt, and whether the call starts its workers again.

An attempt of a call (:mod:`.launcher`) ends in outputs or in one :class:`Failure`: the error the
driver would raise, the rank and node it came from, and its :class:`Kind`, read from the error's
type and origin by :func:`classify`. :func:`decide` is the whole policy: a pure function of the
failure, the restarts taken so far and ``max_failures``, which the unit tests call directly.

Decisions:

* A restart can fix what happened to the workers, not what their code did. It follows: a worker
  process that died (killed, out of memory) on a node that is still there, a node that was lost or
  drained for preemption, a worker that died while starting, a collective that broke because a peer
  went away (raised in the survivors), and a worker about to go away once rank 0 has checkpointed
  for it. An exception raised by the user's code (``training_step``, a callback, a data loader) is
  not retried: it is almost always deterministic, and running it ``max_failures`` more times would
  only waste the cluster's time before failing the same way (Ray Train retries everything). Neither
  is a stuck rank (``WorkerHangError``) nor a cluster too small for the workers.
* After a worker process died, or a node was lost, the restart keeps the other workers' processes
  (:meth:`~ray_lightning.launch.worker_group.WorkerGroup.salvage`: a lost node's workers start again where Ray
  places their bundles anew, or an elastic fit goes on without them), and with them their state in memory: the
  restart goes on from the step they reached. After a preempted node (rank 0 checkpointed for it), or a death while
  starting, it starts a new group wherever the cluster can hold it.
* A broken collective is recognised by its type: torch's ``DistError`` subclasses, and what the
  strategy names (``strategy.collective_errors``: Horovod's ``HorovodInternalError``). Gloo reports
  a lost peer only as a ``RuntimeError`` whose message says so: those messages are listed here, in
  :data:`PEER_LOST_MESSAGES`, and nowhere else (``tests/test_failures.py`` has a case per message).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch

from ray_lightning.errors import (
    RayWorkerError,
    WorkerDiedError,
    WorkerHangError,
    WorkerPreemptedError,
    WorkersGrowError,
    WorkerStartupError,
)
from ray_lightning.launch.actor import NodeInfo

# What gloo's transport says, inside a plain RuntimeError, when the peer at the other end of a
# connection went away (its process died, or its node): "[.../gloo/transport/tcp/pair.cc:553]
# Connection closed by peer [10.0.0.5]:20354", "Read error ... Connection reset by peer", "Write
# error ... Broken pipe", "Connection refused" (a peer's listener gone while connecting).
PEER_LOST_MESSAGES = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
)


class Kind(enum.Enum):
    """What ended an attempt; the value is what the driver's log and ``Restart.reason`` say."""

    WORKER_DIED = "worker died"
    NODE_LOST = "node lost"
    NODE_PREEMPTED = "node preempted"
    GOING_AWAY = "preempted"
    DIED_STARTING = "worker died while starting"
    PEER_LOST = "collective broken by a peer's loss"
    USER_CODE = "raised by the training code"
    HANG = "no progress"
    OTHER = "other"
    GROW = "grow"  # not a failure: an elastic fit moves onto more workers


# Restarts that are not failures, which max_failures does not count.
RESIZES = frozenset({Kind.GROW})


# Failures after which every worker's part of the call ends by itself (a rank's exception or death breaks the others'
# collectives): the driver may wait for them to come out instead of stopping them.
ENDS_ITSELF = frozenset({Kind.WORKER_DIED, Kind.NODE_LOST, Kind.NODE_PREEMPTED, Kind.PEER_LOST, Kind.USER_CODE})

RESTARTABLE = frozenset(
    {Kind.WORKER_DIED, Kind.NODE_LOST, Kind.NODE_PREEMPTED, Kind.GOING_AWAY, Kind.DIED_STARTING, Kind.PEER_LOST}
)


@dataclass(frozen=True)
class Failure:
    """Why an attempt ended: ``error`` is what the driver raises if no restart follows; ``at``: when the driver
    learned of it (``time.time()``)."""

    kind: Kind
    error: BaseException
    rank: int = -1
    node: NodeInfo | None = None
    at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Decision:
    """``restart``: start the workers again; ``keep_processes``: the surviving workers' processes run it."""

    restart: bool
    keep_processes: bool = False


def classify(
    error: BaseException,
    nodes: Mapping[int, NodeInfo],
    alive_nodes: Collection[str],
    collective_errors: tuple[type[BaseException], ...] = (),
) -> Failure:
    """The failure ``error`` is. ``nodes``: where each rank ran; ``alive_nodes``: the node ids alive now.

    A death on a node that is gone is a lost node, whatever Ray says of the process.
    """
    rank = getattr(error, "rank", -1)
    node = nodes.get(rank)
    if isinstance(error, WorkersGrowError):
        kind = Kind.GROW
    elif isinstance(error, WorkerHangError):
        kind = Kind.HANG
    elif isinstance(error, WorkerPreemptedError):
        kind = Kind.GOING_AWAY
    elif isinstance(error, WorkerDiedError):
        if error.preempted:
            kind = Kind.NODE_PREEMPTED
        elif node is None or node.node_id not in alive_nodes:
            kind = Kind.NODE_LOST  # rank -1: the driver channel's queue, lost with its node
        else:
            kind = Kind.WORKER_DIED
    elif isinstance(error, WorkerStartupError):
        kind = Kind.DIED_STARTING
    elif isinstance(error, RayWorkerError):
        lost = caused_by_peer_loss(error.__cause__, collective_errors)
        kind = Kind.PEER_LOST if lost else Kind.USER_CODE
    else:
        kind = Kind.OTHER
    return Failure(kind, error, rank, node)


def decide(failure: Failure, restarts_done: int, max_failures: int) -> Decision:
    """Restart or raise: see the module docstring. ``restarts_done`` counts failures only (not resizes)."""
    if failure.kind in RESIZES:  # into room the fit holds: the running processes go on (launch.elastic)
        return Decision(restart=True, keep_processes=True)
    if failure.kind not in RESTARTABLE or restarts_done >= max_failures:
        return Decision(restart=False)
    return Decision(restart=True, keep_processes=failure.kind in (Kind.WORKER_DIED, Kind.NODE_LOST))


def caused_by_peer_loss(error: BaseException | None, collective_errors: tuple[type[BaseException], ...] = ()) -> bool:
    """Whether a worker's exception ``error``, or one behind it (what it was raised from, or during), is a collective
    broken by a peer's loss."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if _is_peer_loss(error, collective_errors):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _is_peer_loss(error: BaseException, collective_errors: tuple[type[BaseException], ...]) -> bool:
    if isinstance(error, (torch.distributed.DistError, *collective_errors)):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(message in text for message in PEER_LOST_MESSAGES)
