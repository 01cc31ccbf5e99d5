"""How the workers of a call meet: a rendezvous that rank 0's actor opens and keeps open while training.

A strategy names its rendezvous as an object (``strategy.rendezvous``) that the launcher sends to
rank 0's actor, where :meth:`Rendezvous.open` binds a port the OS picks on rank 0's node IP (never
every interface: :mod:`.network`), in the process that keeps it open, so no other process can take
the port between choosing and using it, and concurrent fits on one node never collide. What comes
back (:class:`RendezvousPoint`) is handed to every worker.

:class:`TorchStoreRendezvous` is torch.distributed's TCPStore (DDP and the sharded strategies);
Horovod's lives in :mod:`ray_lightning.horovod.rendezvous`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import ray

from ray_lightning.launch.network import listening_socket


@dataclass(frozen=True)
class RendezvousPoint:
    """Where the workers meet: rank 0's ``port``, and per global rank the extra environment that worker needs."""

    port: int
    rank_env: list[dict[str, str]] = field(default_factory=list)


class Rendezvous(Protocol):
    """Opened in rank 0's actor; picklable, since it travels there from the driver."""

    def open(self, nodes_by_rank: list[str], timeout_s: float) -> tuple[Any, RendezvousPoint]:
        """Start listening. ``nodes_by_rank``: the Ray node id of each global rank.

        Returns the object to keep alive while the call runs (the store or server; its ``close()``,
        if it has one, is called when the call ends), and the point the workers meet at.
        """


class TorchStoreRendezvous:
    """torch.distributed's TCPStore, opened by rank 0 on its node IP; the other ranks connect as clients."""

    def open(self, nodes_by_rank: list[str], timeout_s: float) -> tuple[Any, RendezvousPoint]:
        store = open_bound_store(ray.util.get_node_ip_address(), timeout_s)
        return store, RendezvousPoint(store.port, [{} for _ in nodes_by_rank])


def open_bound_store(host: str, timeout_s: float) -> Any:
    """A master TCPStore listening on ``host`` only (a TCPStore given no socket listens on every interface)."""
    from torch.distributed import TCPStore

    with listening_socket(host) as sock:
        # The store owns (and closes) the descriptor it is given, also when its construction fails
        # half-way; it gets a duplicate, and `with` closes ours either way.
        def store(**backend: Any) -> Any:
            return TCPStore(
                host,
                sock.getsockname()[1],  # the real port: the non-libuv store checks it against the socket's
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout_s),
                master_listen_fd=os.dup(sock.fileno()),
                **backend,
            )

        try:
            return store()
        except NotImplementedError:
            # torch 2.4's default (libuv) store takes no listening socket; its legacy one does.
            return store(use_libuv=False)
