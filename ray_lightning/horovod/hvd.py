"""Finding Horovod, and ``hvd.init`` in a worker whose environment the launcher has set."""

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
