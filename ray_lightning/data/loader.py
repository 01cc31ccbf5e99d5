"""What a rank iterates: its batches of a dataset's passes, cut from blocks it fetches itself.

For each batch the rank works out which positions of the pass's order it trains (:class:`~.order.Deal`), asks the
coordinator for the windows holding them (metadata: block references and a seed), fetches those blocks straight
from the object store (zero-copy where they are on its node) and gathers its rows into one array per column: one
copy per row, made by the rank that trains it. A thread assembles the next batches while the current one trains.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ray_lightning.data.coordinator import End, Pending
from ray_lightning.data.order import Deal, DealSpec, Intervals, Rest, Window, batches_per_rank

PREFETCH = 2  # batches a rank assembles ahead of the one it trains on
MASK = "mask"  # the column a padded training batch carries: True for real rows, False for padding


@dataclass(frozen=True)
class PassStart:
    """How a rank starts a pass: the coordinator's ``key`` and ``spec`` (a ``coordinator.PassSpec``), the
    positions the deal leaves out (``base``), the first batch of the rank's stream to read, the pass's length where
    known before reading it, and every position trained before (``trained``: the coordinator skips them)."""

    key: tuple
    spec: Any
    base: list = field(default_factory=list)
    first_batch: int = 0
    total: int | None = None
    trained: list = field(default_factory=list)


@dataclass(frozen=True)
class LoaderSpec:
    """``batch_size`` rows a batch, pieces up to ``cap`` rows, ``mode`` one of ``order.MODES``."""

    batch_size: int
    mode: str
    cap: int


class RayDataLoader:
    """One rank's loader of one dataset: each ``iter()`` is a pass (an epoch, a validation run...).

    ``length``: batches this rank gets per pass where the row count is known, else None (``len()`` raises
    ``TypeError``, which Lightning takes as a loader of unknown length). ``start``: called at each pass's start,
    returns its :class:`PassStart`.
    """

    def __init__(
        self,
        coordinator: Any,
        spec: LoaderSpec,
        rank: int,
        world_size: int,
        attempt: str,
        length: int | None,
        start: Any,
        name: str = "train",
        timeout_s: float = 600.0,
    ) -> None:
        self.coordinator = coordinator
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.length = length
        self._start = start
        self.name = name
        self.timeout_s = timeout_s
        self.positions: list[list[int]] = []  # an evaluation pass's batches' positions: its dataset order
        self.reader: PassReader | None = None  # the current pass's

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("the dataset's row count is unknown until it is read")
        return self.length

    def __iter__(self) -> Iterator[dict[str, Any]]:
        start = self._start()
        self.positions = []
        reader = self.reader = PassReader(self, start)
        yield from reader.batches()


class PassReader:
    """One rank's reading of one pass (see the module docstring)."""

    def __init__(self, loader: RayDataLoader, start: PassStart) -> None:
        self.loader = loader
        self.start = start
        self.rest = Rest(Intervals(start.base))
        world, spec = loader.world_size, loader.spec
        total = self.rest.length(start.total) if start.total is not None else None
        self.deal = Deal(DealSpec(world, spec.batch_size, spec.cap, spec.mode), total)
        self._windows: dict[int, Window] = {}
        self._columns: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        self._padding: dict[str, np.ndarray] | None = None
        self._stop = threading.Event()
        self._low = 0
        self._wait(
            loader.coordinator.open.remote(start.key, loader.attempt, world, start.spec, start.trained or start.base),
            "the pass to open",
        )

    # -- the training thread's side ---------------------------------------------------------------------------

    def batches(self) -> Iterator[dict[str, Any]]:
        made: queue.Queue = queue.Queue(maxsize=PREFETCH)
        thread = threading.Thread(target=self._assemble, args=(made,), name="ray_lightning-data", daemon=True)
        thread.start()
        try:
            while True:
                try:
                    kind, value, positions = made.get(timeout=1.0)
                except queue.Empty:
                    if not thread.is_alive():
                        raise RuntimeError("RayDataModule: the rank's data thread ended without a word") from None
                    continue
                if kind == "error":
                    raise value
                if kind == "end":
                    return
                if self.deal.spec.mode == "eval":  # what predict needs; a training epoch's would only grow
                    self.loader.positions.append(positions.tolist())
                yield value
        finally:
            self._stop.set()
            # Read to the end or left early (limit_*_batches, max_steps): either way this rank needs no more of it.
            self.loader.coordinator.finished.remote(self.start.key, self.loader.attempt, self.loader.rank)

    # -- the assembling thread ---------------------------------------------------------------------------------

    def _assemble(self, made: queue.Queue) -> None:
        try:
            if self.deal.spec.mode == "pad":
                self._padding = self._first_rows()
            k = self.start.first_batch
            while not self._stop.is_set():
                batch = self._batch(k)
                if batch is None:
                    break
                self._put(made, ("batch", *batch))
                k += 1
            self._put(made, ("end", None, None))
        except BaseException as error:  # noqa: BLE001 - raised in the training thread
            self._put(made, ("error", error, None))

    def _put(self, made: queue.Queue, item: tuple) -> None:
        while not self._stop.is_set():
            try:
                made.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def _batch(self, k: int) -> tuple[dict[str, Any], np.ndarray] | None:
        """Batch ``k`` of this rank's stream as tensors and its positions, or None past the pass's end."""
        deal, size, rank = self.deal, self.loader.spec.batch_size, self.loader.rank
        spans = deal.stream(rank, k * size, (k + 1) * size, self.reach)
        self._check_first_pass()
        real = sum(b - a for a, b in spans)
        wanted = batches_per_rank(deal.total, deal.spec, rank) if deal.total is not None else None
        if real == 0 and (wanted is None or k >= wanted):
            return None
        if deal.spec.mode == "drop" and real < size:
            return None
        positions = [p for a, b in spans for p in self.rest.positions(a, b)]
        columns, order = self._gather(positions)
        if deal.spec.mode == "pad":
            columns = self._padded(columns, real, size)
        return to_tensors(columns), order

    def _check_first_pass(self) -> None:
        """A whole training pass too small for one step fails (not an epoch of no steps): naming the rows."""
        deal, start = self.deal, self.start
        if deal.total is None or start.trained or start.first_batch or deal.spec.mode == "eval":
            return
        need = deal.spec.world * deal.spec.batch if deal.spec.mode == "drop" else 1
        if deal.total < need:
            raise ValueError(
                f"RayDataModule: the {self.loader.name} dataset had {deal.total} rows; one training step on "
                f"{deal.spec.world} workers x batch_size {deal.spec.batch} needs {need}. Give it more rows, lower "
                "batch_size, or use last_batch='pad'."
            )

    def reach(self, q: int) -> int | None:
        """None when the pass has ``q`` positions to deal, else ``Q``'s length (waits for the pipeline)."""
        position = self.rest.position(q - 1)
        found = self._call("reach", position)
        return None if found is True else self.rest.length(found.total)

    def _call(self, method: str, position: int) -> Any:
        """The coordinator's answer for ``position``; waits while it is Pending, within the batch timeout, which
        a resume's skip of trained rows does not count."""
        loader = self.loader
        deadline, skipped = time.monotonic() + loader.timeout_s, -1
        while True:
            if method == "window":
                ask = loader.coordinator.window.remote(self.start.key, loader.attempt, position, loader.rank, self._low)
            else:
                ask = loader.coordinator.reach.remote(self.start.key, loader.attempt, position)
            found = self._wait(ask, f"its next {loader.name} batch")
            if not isinstance(found, Pending):
                return found
            if found.skipped > skipped:
                deadline, skipped = time.monotonic() + loader.timeout_s, found.skipped
            if self._stop.is_set():
                raise _Left()
            if time.monotonic() > deadline:
                raise _waited_too_long(loader, "its next batch")

    def _wait(self, request: Any, what: str) -> Any:
        import ray

        try:
            return ray.get(request, timeout=self.loader.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise _waited_too_long(self.loader, what) from None

    # -- rows -----------------------------------------------------------------------------------------------------

    def _window(self, position: int) -> Window:
        for window in self._windows.values():
            if window.start <= position < window.end:
                return window
        found = self._call("window", position)
        if isinstance(found, End):
            raise LookupError(f"position {position} is past the pass's end ({found.total})")
        for index in [i for i, w in self._windows.items() if w.end <= self._low]:
            del self._windows[index]  # passed: its blocks' arrays go too
            for key in [key for key in self._columns if key[0] == index]:
                del self._columns[key]
        self._windows[found.index] = found
        return found

    def _gather(self, positions: list[tuple[int, int]], low: bool = True) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The rows at these positions, in order, as one array per column; and the positions. ``low``: nothing
        before them is needed any more."""
        if positions and low:
            self._low = positions[0][0]
        pieces: list[tuple[Window, np.ndarray]] = []  # (window, its rows' indices into its parts laid end to end)
        for a, b in positions:
            while a < b:
                window = self._window(a)
                hi = min(b, window.end)
                pieces.append((window, window.rows_in_order()[a - window.start : hi - window.start]))
                a = hi
        order = np.concatenate([np.arange(a, b) for a, b in positions]) if positions else np.zeros(0, np.int64)
        return self._columns_of(pieces), order

    def _columns_of(self, pieces: list[tuple[Window, np.ndarray]]) -> dict[str, np.ndarray]:
        found: list[tuple[Window, int, np.ndarray, np.ndarray]] = []  # (window, part, its rows, their out slots)
        offset = 0
        for window, rows in pieces:
            ends = np.cumsum([p.rows for p in window.parts])
            part_of = np.searchsorted(ends, rows, side="right")
            for i in np.unique(part_of):
                slots = np.nonzero(part_of == i)[0]
                found.append((window, int(i), rows[slots] - (ends[i] - window.parts[i].rows), slots + offset))
            offset += len(rows)
        self._fetch([(window, i) for window, i, _, _ in found])
        sources = [(self._columns[(w.index, i)], rows, slots) for w, i, rows, slots in found]
        return gather(sources, offset, self.loader.name)

    def _fetch(self, wanted: list[tuple[Window, int]]) -> None:
        """The blocks of these parts as arrays, fetched from the object store together where not held yet."""
        from ray.data.block import BlockAccessor

        missing = {(w.index, i): w.parts[i] for w, i in wanted if (w.index, i) not in self._columns}
        if not missing:
            return
        blocks = self._wait([part.ref for part in missing.values()], f"the blocks of its next {self.loader.name} batch")
        for (key, part), block in zip(missing.items(), blocks):
            accessor = BlockAccessor.for_block(block)
            if part.offset or part.rows != accessor.num_rows():
                accessor = BlockAccessor.for_block(accessor.slice(part.offset, part.offset + part.rows, False))
            arrays = accessor.to_numpy()
            self._columns[key] = arrays if isinstance(arrays, dict) else {"data": arrays}

    def _first_rows(self) -> dict[str, np.ndarray]:
        """The pass's first batch of rows (what pads its last step), read before any window is released."""
        size = self.loader.spec.batch_size
        total = self.deal.total if self.deal.total is not None else self.reach(size)
        columns, _ = self._gather(self.rest.positions(0, size if total is None else min(size, total)), low=False)
        return columns

    def _padded(self, columns: dict[str, np.ndarray], real: int, size: int) -> dict[str, np.ndarray]:
        """A training batch of ``size`` rows: its ``real`` rows, then the pass's first rows again, masked out."""
        assert self._padding is not None
        pad = size - real
        fill = {name: np.resize(values, (pad, *values.shape[1:])) for name, values in self._padding.items()}
        out = {name: np.concatenate([columns[name], fill[name]]) if real else fill[name] for name in fill}
        out[MASK] = np.arange(size) < real
        return out


def gather(sources: list[tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]], rows: int, name: str):
    """One array per column of ``rows`` rows: ``out[slots] = block[rows]`` for each source (one copy per row).
    Blocks whose column types differ are promoted where numpy can (int to float); otherwise a TypeError names the
    column and the types."""
    if not sources:
        return {}
    out: dict[str, np.ndarray] = {}
    for column in sources[0][0]:
        arrays = []
        for block, _, _ in sources:
            if column not in block:
                raise TypeError(
                    f"RayDataModule: a block of the {name} dataset has no column {column!r} (it has "
                    f"{sorted(block)}); give every block the same columns (map_batches, select_columns)."
                )
            arrays.append(block[column])
        shapes = {a.shape[1:] for a in arrays}
        kinds = {a.dtype for a in arrays}
        numeric = all(d.kind in "biuf" for d in kinds)
        if len(shapes) > 1 or (len(kinds) > 1 and not numeric):
            found = sorted({f"{d}{list(s)}" for d, s in ((a.dtype, a.shape[1:]) for a in arrays)})
            raise TypeError(
                f"RayDataModule: the {name} dataset's column {column!r} changes type between blocks "
                f"({', '.join(found)}); cast it to one type in the dataset (map_batches) so every block has the same."
            )
        dtype = np.result_type(*kinds) if len(kinds) > 1 else arrays[0].dtype
        values = np.empty((rows, *arrays[0].shape[1:]), dtype=dtype)
        for array, (_, picked, slots) in zip(arrays, sources):
            values[slots] = array[picked]
        out[column] = values
    return out


def to_tensors(columns: dict[str, np.ndarray]) -> dict[str, Any]:
    """``{column: tensor}``; a column of strings or objects stays a numpy array. The arrays are the batch's own
    (``gather`` made them), so the tensors share their memory."""
    return {
        name: torch.from_numpy(values) if values.dtype.kind in "biufc" else values for name, values in columns.items()
    }


class _Left(Exception):
    """The training thread left the pass (its loop ended early): the assembling thread stops."""


def _waited_too_long(loader: RayDataLoader, what: str) -> TimeoutError:
    return TimeoutError(
        f"RayDataModule: rank {loader.rank} waited {loader.timeout_s:g} s for {what} of the {loader.name} dataset "
        "(RayDataModule(batch_timeout_s=...), RAY_LIGHTNING_DATA_TIMEOUT_S). Ray Data's tasks (reads, map_batches) "
        "need CPUs the training workers do not hold: check that the cluster has free CPUs (ray status) and that "
        "the dataset's reads and functions finish. A resume's skip of trained rows is not counted."
    )
