"""Horovod's rendezvous on Ray: horovod.ray's own, run by rank 0's actor.

The rendezvous is horovod.ray's :class:`horovod.ray.runner.Coordinator` (which runs Horovod's
HTTP rendezvous server and computes local/cross ranks), but it runs in rank 0's actor rather than
on the driver as :class:`horovod.ray.RayExecutor` does: a driver connected through Ray Client, or
behind NAT, is often unreachable from the workers, while rank 0 always is.
"""

from __future__ import annotations

import os
from typing import Any

from ray_lightning.launch.rendezvous import RendezvousPoint


class HorovodRendezvous:
    """horovod.ray's Gloo rendezvous server, opened in rank 0's actor (see the module docstring)."""

    def open(self, nodes_by_rank: list[str], timeout_s: float) -> tuple[Any, RendezvousPoint]:
        """Start Horovod's rendezvous server in this process (rank 0's actor).

        ``nodes_by_rank`` is the Ray node id of each global rank; ranks on one node are consecutive.
        Returns the server (keep it alive while training) and the point with each rank's Horovod
        environment (``HOROVOD_RANK``, ``HOROVOD_LOCAL_RANK``, ``HOROVOD_CROSS_RANK``, the server's
        address, ...).
        """
        return _open(nodes_by_rank, timeout_s)


def _open(nodes_by_rank: list[str], timeout_s: float) -> tuple[Any, RendezvousPoint]:
    from horovod.ray.runner import Coordinator, MiniSettings

    coordinator = Coordinator(MiniSettings(verbose=0, timeout_s=int(timeout_s)))
    for rank, node in enumerate(nodes_by_rank):
        # Horovod groups ranks by "hostname"; the Ray node id is unique even where hostnames repeat.
        coordinator.register(hostname=node, node_id=node, world_rank=rank)
    per_rank = coordinator.finalize_registration()
    common = coordinator.establish_rendezvous()
    size = len(nodes_by_rank)
    rank_env = [
        {
            **common,
            **{k: str(v) for k, v in per_rank[rank].items()},
            "HOROVOD_RANK": str(rank),
            "HOROVOD_SIZE": str(size),
            "HOROVOD_HOSTNAME": node,
            # Gloo's own default (30 s) is too short for workers still importing torch on a busy node.
            "HOROVOD_GLOO_TIMEOUT_SECONDS": os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", str(int(timeout_s))),
        }
        for rank, node in enumerate(nodes_by_rank)
    ]
    return coordinator.rendezvous, RendezvousPoint(int(common["HOROVOD_GLOO_RENDEZVOUS_PORT"]), rank_env)
