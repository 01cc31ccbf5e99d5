"""What a rank iterates: its batches of a dataset's passes, fetched from the dealer, as dicts of tensors."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ray_lightning.data.dealer import PassSpec

PREFETCH = 2  # batches a rank asks the dealer for ahead of the one it trains on


def to_tensors(table: Any) -> dict[str, Any]:
    """An Arrow table as ``{column: tensor}`` (one row per sample); a column of strings or objects stays a
    numpy array."""
    from ray.data.block import BlockAccessor

    columns = BlockAccessor.for_block(table).to_numpy(table.column_names)
    if not isinstance(columns, dict):
        columns = {table.column_names[0]: columns}
    batch: dict[str, Any] = {}
    for name, values in columns.items():
        values = np.asarray(values)
        numeric = values.dtype.kind in "biufc"
        # A copy: the object store's buffers are read-only, and a training step may write into its batch.
        batch[name] = torch.from_numpy(values.copy()) if numeric else values
    return batch


class RayDataLoader:
    """One rank's loader of one dataset: each ``iter()`` is a pass (an epoch, a validation run...).

    ``length``: batches this rank gets per pass where the row count is known, else None (``len()`` raises
    ``TypeError``, which Lightning takes as a loader of unknown length). ``start``: called at each pass's start,
    returns ``(seed, skip_rows)``: the pass's shuffle seed and the rows a resumed epoch already trained.
    """

    def __init__(
        self,
        dealer: Any,
        spec: PassSpec,
        rank: int,
        world_size: int,
        attempt: str,
        length: int | None,
        start: Callable[[], tuple[int | None, int]],
        name: str = "train",
        timeout_s: float = 600.0,
    ) -> None:
        self.dealer = dealer
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.length = length
        self._start = start
        self.name = name
        self.timeout_s = timeout_s
        self._passes = 0
        self.positions: list[range] = []  # the dataset positions of each batch of the current pass

    def _wait(self, request: Any) -> Any:
        import ray

        try:
            return ray.get(request, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"RayDataModule: rank {self.rank} waited {self.timeout_s:g} s for its next {self.name} batch "
                "(RayDataModule(batch_timeout_s=...), RAY_LIGHTNING_DATA_TIMEOUT_S). Ray Data's tasks (reads, "
                "map_batches) need CPUs the training workers do not hold: check that the cluster has free CPUs "
                "(ray status) and that the dataset's reads and functions finish."
            ) from None

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("the dataset's row count is unknown until it is read")
        return self.length

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import ray

        index = self._passes
        self._passes += 1
        seed, skip = self._start()
        self.positions = []
        world, size = self.world_size, self.spec.batch_size
        pending: collections.deque = collections.deque()
        k = 0

        def ask(step: int) -> None:
            start = (world, seed, skip)
            pending.append(self.dealer.batch.remote(self.attempt, index, start, step * world + self.rank))

        for step in range(PREFETCH):
            ask(step)
        while pending:
            found = self._wait(pending.popleft())
            if found is None:
                return
            ask(k + PREFETCH)
            table = ray.get(found[0])
            g = k * world + self.rank
            self.positions.append(range(skip + g * size, skip + g * size + table.num_rows))
            k += 1
            yield to_tensors(table)
