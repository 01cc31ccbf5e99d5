"""Where a restart is decided (``ray_lightning.launch.failures``): the kind of each failure, and restart or raise.

No Ray: ``classify`` and ``decide`` are pure, and the one broken collective that can be produced here
(a gloo peer killed in an all-reduce) is produced for real.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ray_lightning.errors import (
    ClusterResourceError,
    RayWorkerError,
    WorkerDiedError,
    WorkerHangError,
    WorkerPreemptedError,
    WorkerStartupError,
    WorkerStartupTimeoutError,
)
from ray_lightning.launch.actor import NodeInfo
from ray_lightning.launch.failures import PEER_LOST_MESSAGES, RESIZES, Decision, Failure, Kind, classify, decide

NODES = {0: NodeInfo("node-a", "10.0.0.1", 100, []), 1: NodeInfo("node-b", "10.0.0.2", 200, [])}
BOTH_ALIVE = {"node-a", "node-b"}


def _raised(cause: BaseException, rank: int = 1) -> RayWorkerError:
    """What the driver raises for a worker's exception: the worker's own exception is its cause."""
    error = RayWorkerError(f"ray_lightning worker rank {rank} raised an exception.\n{cause!r}", rank=rank)
    error.__cause__ = cause
    return error


class HorovodLikeError(RuntimeError):
    """Stands for a strategy's own collective error type (Horovod's HorovodInternalError)."""


@pytest.mark.parametrize(
    "error, alive, kind",
    [
        (WorkerDiedError("rank 1 died", rank=1), BOTH_ALIVE, Kind.WORKER_DIED),
        (WorkerDiedError("rank 1 died", rank=1), {"node-a"}, Kind.NODE_LOST),
        (WorkerDiedError("rank 1 died", rank=1, preempted=True), BOTH_ALIVE, Kind.NODE_PREEMPTED),
        (WorkerDiedError("the driver channel died", rank=-1), BOTH_ALIVE, Kind.NODE_LOST),
        (WorkerStartupError("rank 0 died while starting", rank=0), BOTH_ALIVE, Kind.DIED_STARTING),
        (WorkerPreemptedError("node going", rank=0), BOTH_ALIVE, Kind.GOING_AWAY),
        (_raised(torch.distributed.DistNetworkError("store went away")), BOTH_ALIVE, Kind.PEER_LOST),
        (_raised(torch.distributed.DistBackendError("NCCL error: remote process exited")), BOTH_ALIVE, Kind.PEER_LOST),
        (_raised(HorovodLikeError("Horovod has been shut down")), BOTH_ALIVE, Kind.PEER_LOST),
        (_raised(ValueError("a bug in training_step")), BOTH_ALIVE, Kind.USER_CODE),
        (_raised(RuntimeError("CUDA out of memory")), BOTH_ALIVE, Kind.USER_CODE),
        (WorkerHangError("stuck", rank=1), BOTH_ALIVE, Kind.HANG),
        (WorkerStartupTimeoutError("workers did not start"), BOTH_ALIVE, Kind.OTHER),
        (ClusterResourceError("no GPUs"), BOTH_ALIVE, Kind.OTHER),
    ],
)
def test_each_failure_has_its_kind_from_its_type_and_origin(error, alive, kind):
    failure = classify(error, NODES, alive, collective_errors=(HorovodLikeError,))
    assert failure.kind is kind
    assert failure.error is error and failure.rank == getattr(error, "rank", -1)
    assert failure.node == NODES.get(failure.rank)


# One real message of each kind gloo raises in a survivor (a plain RuntimeError: torch gives only the text).
GLOO_MESSAGES = {
    "connection closed by peer": "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
    "peer [10.0.0.2]:20354. This is typically caused by a remote worker crashing.",
    "connection reset by peer": "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:5128: "
    "Connection reset by peer",
    "broken pipe": "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Write error [10.0.0.2]:5128: Broken pipe",
    "connection refused": "[../third_party/gloo/gloo/transport/tcp/pair.cc:144] connect [10.0.0.2]:5128: "
    "Connection refused",
}


@pytest.mark.parametrize("message", PEER_LOST_MESSAGES)
def test_each_peer_loss_message_is_a_broken_collective(message):
    assert message in GLOO_MESSAGES, "every message listed has a real example here"
    failure = classify(_raised(RuntimeError(GLOO_MESSAGES[message])), NODES, BOTH_ALIVE)
    assert failure.kind is Kind.PEER_LOST
    # The same words from the user's own code, as another exception type, are the user's.
    assert classify(_raised(ValueError(GLOO_MESSAGES[message])), NODES, BOTH_ALIVE).kind is Kind.USER_CODE


def _all_reduce_until_the_peer_dies(rank: int, port: int, errors: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    if rank == 1:
        os._exit(1)  # dies as a killed worker does: no goodbye to its peer
    try:
        for _ in range(50):
            dist.all_reduce(tensor)
    except Exception as error:  # noqa: BLE001 - what the survivor saw is the test's subject
        errors.send((type(error).__name__, str(error)))  # a pipe: sent before the process exits
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_real_gloo_peer_death_is_a_broken_collective():
    context = multiprocessing.get_context("spawn")
    received, errors = context.Pipe(duplex=False)
    port = _free_port()
    processes = [context.Process(target=_all_reduce_until_the_peer_dies, args=(r, port, errors)) for r in (0, 1)]
    for process in processes:
        process.start()
    try:
        assert received.poll(120), "the survivor raised nothing within 120 s"
        name, text = received.recv()
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert classify(_raised(RuntimeError(text), rank=0), NODES, BOTH_ALIVE).kind is Kind.PEER_LOST, (name, text)


@pytest.mark.parametrize("kind", [k for k in Kind if k not in RESIZES])
def test_restart_or_raise(kind):
    failure = Failure(kind, RuntimeError("x"), rank=1, node=NODES[1])
    restartable = kind in {
        Kind.WORKER_DIED,
        Kind.NODE_LOST,
        Kind.NODE_PREEMPTED,
        Kind.GOING_AWAY,
        Kind.DIED_STARTING,
        Kind.PEER_LOST,
    }
    assert decide(failure, restarts_done=0, max_failures=2) == Decision(
        restart=restartable, keep_processes=restartable and kind in (Kind.WORKER_DIED, Kind.NODE_LOST)
    )
    assert decide(failure, restarts_done=2, max_failures=2) == Decision(restart=False), "max_failures spent"
    assert decide(failure, restarts_done=0, max_failures=0) == Decision(restart=False), "restarts off"
