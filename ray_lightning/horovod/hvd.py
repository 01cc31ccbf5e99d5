"""Finding Horovod, and ``hvd.init`` in a worker whose environment the launcher has set."""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any

from ray_lightning.launch.network import interface_for

INSTALL_HINT = (
    "HorovodRayStrategy needs Horovod built with PyTorch and Gloo support. From a ray_lightning checkout, "
    "`python3 dev.py test` builds and caches it; elsewhere build Horovod 0.28.1 as the documentation's "
    "'Installing Horovod' (docs/horovod.md) shows (torch >= 2.1 needs it compiled as C++17), then "
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


def hostname_address() -> str | None:
    """The address this machine's hostname resolves to first (what gloo binds without an interface), or None."""
    try:
        return str(socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        return None


def unreachable_hostname(hostname: str, address: str | None, node_ip: str) -> str | None:
    """Why peers on other machines could not reach this worker's Horovod, or None if they can.

    Horovod 0.28.1 builds the Gloo context of its global process set from the address the
    hostname resolves to: that context ignores ``HOROVOD_GLOO_IFACE`` (its interface field is never
    set). A hostname that resolves to loopback, or to nothing, works on one machine only.
    """
    if address is not None and not ipaddress.ip_address(address.split("%")[0]).is_loopback:
        return None
    resolved = f"resolves to {address}" if address else "does not resolve"
    return (
        f"HorovodRayStrategy cannot train across machines from this node: its hostname {hostname!r} {resolved}, "
        "and Horovod's process-set Gloo context listens on the hostname's address (it ignores HOROVOD_GLOO_IFACE), "
        f"which workers on other machines cannot reach. Make {hostname!r} resolve to this node's IP {node_ip} "
        "(e.g. a line in /etc/hosts) on every node, or train with RayStrategy."
    )


def init_horovod(node_ip: str, across_machines: bool = False) -> Any:
    """``hvd.init()`` in a worker whose environment the launcher has set; returns ``horovod.torch``.

    ``across_machines``: the workers run on more than one machine (node IP).
    """
    hvd = import_horovod_torch()
    if across_machines:
        problem = unreachable_hostname(socket.gethostname(), hostname_address(), node_ip)
        if problem:
            raise RuntimeError(problem)
    # Gloo binds to the interface named here. Ray already knows which address of this node its
    # peers reach (the node IP), so use that interface instead of horovod.ray's probing of all
    # hosts' interfaces, which needs extra actors and fails where interface names differ per node.
    if "HOROVOD_GLOO_IFACE" not in os.environ:
        iface = interface_for(node_ip)
        if iface:
            os.environ["HOROVOD_GLOO_IFACE"] = iface
    hvd.init()
    return hvd
