"""Horovod's rendezvous on Ray: horovod.ray's own, run by rank 0's actor.

The rendezvous is horovod.ray's :class:`horovod.ray.runner.Coordinator` (which runs Horovod's
HTTP rendezvous server and computes local/cross ranks), but it runs in rank 0's actor rather than
on the driver as :class:`horovod.ray.RayExecutor` does: a driver connected through Ray Client, or
behind NAT, is often unreachable from the workers, while rank 0 always is. Its HTTP server listens
on rank 0's node IP only, on a port the OS picks (Horovod's own binds every interface).
"""

from __future__ import annotations

import functools
import os
import socket
from typing import Any

import ray

from ray_lightning.launch.rendezvous import RendezvousPoint


class HorovodRendezvous:
    """horovod.ray's Gloo rendezvous server, opened in rank 0's actor (see the module docstring)."""

    def open(self, nodes_by_rank: list[str], timeout_s: float) -> tuple[Any, RendezvousPoint]:
        """Start Horovod's rendezvous server in this process (rank 0's actor).

        ``nodes_by_rank`` is the Ray node id of each global rank; ranks on one node are consecutive.
        Returns the server (kept alive while training, closed when the call ends) and the point with
        each rank's Horovod environment (``HOROVOD_RANK``, ``HOROVOD_LOCAL_RANK``,
        ``HOROVOD_CROSS_RANK``, the server's address, ...).
        """
        return _open(nodes_by_rank, timeout_s)


@functools.cache
def _bound_coordinator_class() -> type:
    """horovod.ray's ``Coordinator``, with its HTTP rendezvous server on one address and an OS-chosen port.

    Horovod's own server binds ``0.0.0.0`` (every interface) and probes random ports; neither
    ``Coordinator`` nor ``RendezvousServer`` takes an address, hence these subclasses (built on
    first use: Horovod is optional).
    """
    from horovod.ray.runner import Coordinator
    from horovod.runner.common.util import hosts
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer, RendezvousServer
    from horovod.runner.util.threads import in_thread

    class BoundRendezvousServer(RendezvousServer):
        def __init__(self, host: str, verbose: int = 0) -> None:
            super().__init__(verbose)
            self.host = host

        def start(self, handler_cls: type = RendezvousHandler) -> int:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            server_class = type("BoundRendezvousHTTPServer", (RendezvousHTTPServer,), {"address_family": family})
            self._httpd = server_class((self.host, 0), handler_cls, self._verbose)
            self._listen_thread = in_thread(target=self._httpd.serve_forever)
            return self._httpd.server_address[1]

        def close(self) -> None:
            """Stop serving and close the listening socket (``stop`` leaves the socket open)."""
            if self._httpd is not None:
                self.stop()
                self._httpd.server_close()
                self._httpd = None

    class BoundCoordinator(Coordinator):
        host = ""

        def establish_rendezvous(self) -> dict[str, str]:
            # Coordinator.establish_rendezvous, with the server above.
            self.rendezvous = BoundRendezvousServer(self.host, self.settings.verbose)
            plan = hosts.get_host_assignments(hosts.parse_hosts(hosts_string=self.node_id_string), self.world_size)
            self.global_rendezv_port = self.rendezvous.start()
            self.rendezvous.init(plan)
            return {
                "HOROVOD_GLOO_RENDEZVOUS_ADDR": self.host,
                "HOROVOD_GLOO_RENDEZVOUS_PORT": str(self.global_rendezv_port),
                "HOROVOD_CONTROLLER": "gloo",
                "HOROVOD_CPU_OPERATIONS": "gloo",
            }

    return BoundCoordinator


def _open(nodes_by_rank: list[str], timeout_s: float) -> tuple[Any, RendezvousPoint]:
    from horovod.ray.runner import MiniSettings

    coordinator = _bound_coordinator_class()(MiniSettings(verbose=0, timeout_s=int(timeout_s)))
    coordinator.host = ray.util.get_node_ip_address()
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
