"""How the workers of a call meet: a rendezvous that rank 0's actor opens and keeps open while training.

A strategy names its rendezvous as an object (``strategy.rendezvous``) that the launcher sends to
rank 0's actor, where :meth:`Rendezvous.open` binds a port the OS picks, in the process that keeps
it open, so no other process can take the port between choosing and using it, and concurrent fits
on one node never collide. What comes back (:class:`RendezvousPoint`) is handed to every worker.

:class:`TorchStoreRendezvous` is torch.distributed's TCPStore (DDP and the sharded strategies);
Horovod's lives in :mod:`ray_lightning.horovod.rendezvous`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol


@dataclass(frozen=True)
class RendezvousPoint:
    """Where the workers meet: rank 0's ``port``, and per global rank the extra environment that worker needs."""

    port: int
    rank_env: list[dict[str, str]] = field(default_factory=list)


class Rendezvous(Protocol):
    """Opened in rank 0's actor; picklable, since it travels there from the driver."""

    def open(self, nodes_by_rank: list[str], timeout_s: float) -> tuple[Any, RendezvousPoint]:
        """Start listening. ``nodes_by_rank``: the Ray node id of each global rank.

        Returns the object to keep alive while the call runs (the store or server), and the point
        the workers meet at.
        """


class TorchStoreRendezvous:
    """torch.distributed's TCPStore, opened by rank 0; the other ranks connect as clients."""

    def open(self, nodes_by_rank: list[str], timeout_s: float) -> tuple[Any, RendezvousPoint]:
        from torch.distributed import TCPStore

        store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        return store, RendezvousPoint(store.port, [{} for _ in nodes_by_rank])
