"""Horovod glue: finding Horovod, its Gloo rendezvous on Ray, and ``hvd.init`` in a worker.

The rendezvous is horovod.ray's own (:class:`horovod.ray.runner.Coordinator`, which runs Horovod's
HTTP rendezvous server and computes local/cross ranks), but it runs in rank 0's actor rather than
on the driver as :class:`horovod.ray.RayExecutor` does: a driver connected through Ray Client, or
behind NAT, is often unreachable from the workers, while rank 0 always is.
"""

from __future__ import annotations

import os
import socket
from typing import Any

INSTALL_HINT = (
    "HorovodRayStrategy needs Horovod built with PyTorch and Gloo support. From a ray_lightning checkout, "
    "`python3 dev.py test` builds and caches it; elsewhere build Horovod 0.28.1 as the README's "
    "'Installing Horovod' section shows (torch >= 2.1 needs it compiled as C++17), then "
    "`pip install ray_lightning[horovod]`."
)


def import_horovod_torch() -> Any:
    """``horovod.torch``, or an ImportError that says how to install it."""
    try:
        import horovod.torch as hvd
    except ImportError as error:
        raise ImportError(f"{INSTALL_HINT} (import failed: {error})") from error
    if not hvd.gloo_built():
        raise ImportError(f"The installed Horovod was built without Gloo, which ray_lightning uses. {INSTALL_HINT}")
    return hvd


def open_rendezvous(nodes_by_rank: list[str], timeout_s: float) -> tuple[Any, int, list[dict[str, str]]]:
    """Start Horovod's rendezvous server in this process (rank 0's actor).

    ``nodes_by_rank`` is the Ray node id of each global rank; ranks on one node are consecutive.
    Returns the server (keep it alive while training), its port, and each rank's Horovod
    environment (``HOROVOD_RANK``, ``HOROVOD_LOCAL_RANK``, ``HOROVOD_CROSS_RANK``, the server's
    address, ...).
    """
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
    return coordinator.rendezvous, int(common["HOROVOD_GLOO_RENDEZVOUS_PORT"]), rank_env


def interface_for(ip: str) -> str | None:
    """The network interface that carries ``ip`` on this machine, or None."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6) and address.address.split("%")[0] == ip:
                return name
    return None


def init_horovod(node_ip: str) -> Any:
    """``hvd.init()`` in a worker whose environment the launcher has set; returns ``horovod.torch``."""
    hvd = import_horovod_torch()
    # Gloo binds to the interface named here. Ray already knows which address of this node its
    # peers reach (the node IP), so use that interface instead of horovod.ray's probing of all
    # hosts' interfaces, which needs extra actors and fails where interface names differ per node.
    if "HOROVOD_GLOO_IFACE" not in os.environ:
        iface = interface_for(node_ip)
        if iface:
            os.environ["HOROVOD_GLOO_IFACE"] = iface
    hvd.init()
    return hvd
