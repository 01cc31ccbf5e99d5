"""Where ranks and devices come from.

The launcher asks every actor which node it landed on and which GPUs Ray gave it, then
:func:`assign_ranks` turns that into global/local/node ranks and :func:`assign_cuda_devices` into
``CUDA_VISIBLE_DEVICES`` and a device index per worker. :class:`RayEnvironment` is the Lightning
``ClusterEnvironment`` that hands those numbers to the strategy inside each worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from typing_extensions import override

from ray_lightning import namespaces


@dataclass(frozen=True)
class WorkerRank:
    global_rank: int
    local_rank: int
    node_rank: int
    local_world_size: int


def assign_ranks(node_ids: Sequence[str]) -> list[WorkerRank]:
    """Ranks for actors that landed on ``node_ids`` (one entry per actor, in actor order).

    Workers on one node get consecutive global ranks; nodes are numbered in the order their
    first actor appears, so actor 0 is always global rank 0. Nodes may hold different numbers of
    workers (a PACK placement group fills nodes unevenly).
    """
    nodes: list[str] = []
    for node in node_ids:
        if node not in nodes:
            nodes.append(node)
    order = sorted(range(len(node_ids)), key=lambda i: (nodes.index(node_ids[i]), i))
    ranks: list[WorkerRank | None] = [None] * len(node_ids)
    local_seen: dict[str, int] = {}
    for global_rank, actor in enumerate(order):
        node = node_ids[actor]
        local = local_seen.get(node, 0)
        local_seen[node] = local + 1
        ranks[actor] = WorkerRank(global_rank, local, nodes.index(node), node_ids.count(node))
    return [r for r in ranks if r is not None]


def assign_cuda_devices(node_ids: Sequence[str], gpu_ids: Sequence[Sequence[str]]) -> list[tuple[str, int | None]]:
    """``(CUDA_VISIBLE_DEVICES, device index)`` for each actor.

    Every worker sees all GPUs reserved by the workers on its node (NCCL needs to see its peers'
    devices for peer-to-peer transfers) and trains on the first GPU Ray reserved for it, found by
    its position in that shared list. Workers with no GPU get ``("", None)``. Two workers with
    fractional shares of one GPU get the same index.
    """
    per_node: dict[str, list[str]] = {}
    for node, ids in zip(node_ids, gpu_ids):
        per_node.setdefault(node, [])
        per_node[node].extend(str(i) for i in ids)
    visible = {node: sorted(set(ids), key=_gpu_sort_key) for node, ids in per_node.items()}
    result: list[tuple[str, int | None]] = []
    for node, ids in zip(node_ids, gpu_ids):
        if not ids:
            result.append(("", None))
            continue
        result.append((",".join(visible[node]), visible[node].index(str(ids[0]))))
    return result


def shares_a_gpu(node_ids: Sequence[str], gpu_ids: Sequence[Sequence[str]]) -> bool:
    """True when two workers on one node were given the same GPU (fractional GPUs): NCCL refuses that."""
    seen: set[tuple[str, str]] = set()
    for node, ids in zip(node_ids, gpu_ids):
        if ids:
            key = (node, str(ids[0]))
            if key in seen:
                return True
            seen.add(key)
    return False


def _gpu_sort_key(gpu_id: str) -> tuple[int, str]:
    return (int(gpu_id), "") if gpu_id.isdigit() else (1 << 30, gpu_id)


class RayEnvironment(namespaces.PerNamespace):
    """Ranks of one worker in a Ray actor group, set by the launcher before training starts.

    A Lightning ``ClusterEnvironment``. On the driver (before launch) it reports rank 0 of
    ``num_workers``. Lightning must not start processes itself: Ray already did.
    """

    lightning_base = "plugins.environments.ClusterEnvironment"
    lightning_fabric = True

    def __init__(self, num_workers: int = 1) -> None:
        super().__init__()
        self._world_size = num_workers
        self._rank = WorkerRank(0, 0, 0, 1)
        self._main_address = "127.0.0.1"
        self._main_port = -1

    def configure(self, rank: WorkerRank, world_size: int, main_address: str, main_port: int) -> None:
        self._rank = rank
        self._world_size = world_size
        self._main_address = main_address
        self._main_port = main_port

    def ran_on(self, world_size: int) -> None:
        """On the driver, after a call: how many workers it ended on (``trainer.world_size``; elastic fits vary)."""
        self._world_size = world_size

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return self._main_address

    @property
    @override
    def main_port(self) -> int:
        return self._main_port

    @staticmethod
    @override
    def detect() -> bool:
        return False

    @override
    def world_size(self) -> int:
        return self._world_size

    @override
    def set_world_size(self, size: int) -> None:
        # The launcher decides the world size; Lightning's guesses from devices/num_nodes are ignored.
        pass

    @override
    def global_rank(self) -> int:
        return self._rank.global_rank

    @override
    def set_global_rank(self, rank: int) -> None:
        pass

    @override
    def local_rank(self) -> int:
        return self._rank.local_rank

    @override
    def node_rank(self) -> int:
        return self._rank.node_rank

    @property
    def local_world_size(self) -> int:
        return self._rank.local_world_size
