"""Where a worker's listeners bind: the address of its Ray node, never every interface.

A fit opens ports of its own besides Ray's: the TCPStore rank 0 opens for the process group
(:mod:`.rendezvous`), the listener gloo (and NCCL's bootstrap) opens in every worker for each
process group, and Horovod's HTTP rendezvous server (:mod:`ray_lightning.horovod.rendezvous`). None
of them authenticates, so none listens on ``0.0.0.0``/``::``: each binds the node IP Ray uses for
that node (``ray.util.get_node_ip_address()``), which every other node already reaches.

* :func:`listening_socket`: a socket listening on one address, on a port the OS picks.
* :func:`interface_for`: the network interface that carries an address (gloo and NCCL take an
  interface name, not an address).
* :func:`listener_environment`: the ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` a worker sets
  before its process group is created, unless they are set already (the user's choice wins).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping


def listening_socket(host: str) -> socket.socket:
    """A TCP socket bound to ``host`` (an IPv4 or IPv6 address) on a port the OS picks, listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def interface_for(ip: str) -> str | None:
    """The network interface that carries ``ip`` on this machine, or None."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6) and address.address.split("%")[0] == ip:
                return name
    return None


def listener_environment(backend: str, interface: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that make a process group of ``backend`` listen on ``interface`` only.

    gloo opens a listener for every process group; without ``GLOO_SOCKET_IFNAME`` it binds the
    address the hostname resolves to (often loopback, unreachable from other nodes). NCCL's
    bootstrap listens on ``NCCL_SOCKET_IFNAME``'s interface, set only when ``backend`` uses NCCL.
    Variables already in ``environ`` are kept; without an ``interface`` nothing is set.
    """
    if interface is None:
        return {}
    names = ["GLOO_SOCKET_IFNAME"]
    if "nccl" in backend.lower():
        names.append("NCCL_SOCKET_IFNAME")
    return {name: interface for name in names if name not in environ}
