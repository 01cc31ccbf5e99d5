"""A pass's one order and how it is dealt to the ranks: pure functions of block metadata, the seed and the epoch,
computed alike by every rank (no Ray here; ``tests/test_data_order.py`` checks them without a cluster).

Terms. A pass reads the dataset once (a training epoch, a validation run...). Its **order** ``S`` numbers its
rows ``0..n-1`` (positions). The dataset's blocks, in dataset order, are grouped into **windows**: a window is
the next run of blocks holding at least ``window_rows`` rows (the first ones fewer, so that the first batch
waits for about one block; the last one may hold fewer). A shuffled pass
numbers a window's rows in a random order seeded by ``(pass seed, window index)``; a materialized dataset's
blocks, which all exist when the pass starts, are first put in a random order seeded by the pass seed. Nothing
of this depends on the number of workers, the batch size or timing: it is the same on every rank and in every
rerun, and a checkpoint can name the trained rows as intervals of ``S`` (:class:`Intervals`).

The **deal** gives each rank contiguous pieces of ``Q``, the pass's positions not trained yet (all of ``S``
unless the pass resumes an epoch): round ``k`` gives every rank one piece of ``c_k`` rows, ``c_0`` = the batch
size, doubling up to ``cap`` (the first step needs one batch per rank, no more; later pieces are a window or so,
so a rank fetches few blocks that another rank also fetches). A round that ``Q`` cannot fill is the **tail**:
its rows are split evenly, so every rank gets the same number of training batches. A rank cuts its batches from
the concatenation of its pieces. Growth: a rank's fetched bytes stay within ``2 (1 + block rows / cap)`` times
the rows it trains, whatever the number of ranks or nodes.
"""

from __future__ import annotations

import bisect
import functools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MODES = ("drop", "pad", "eval")  # training without / with padding of the last step; evaluation (every row once)


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of ``epoch``: different every epoch, the same in every rerun with the same seed."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def _generator(*entropy: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(list(entropy)))


# -- The order ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """Rows ``offset .. offset + rows`` of one block (``ref``: its ObjectRef)."""

    ref: Any
    offset: int
    rows: int
    size_bytes: int = 0


@dataclass(frozen=True)
class Window:
    """A run of blocks: positions ``start .. start + rows`` of the order. ``seed``: its rows' shuffle (None: the
    parts' order)."""

    index: int
    start: int
    rows: int
    parts: tuple[Part, ...]
    seed: int | None = None

    @property
    def end(self) -> int:
        return self.start + self.rows

    def rows_in_order(self) -> np.ndarray:
        """Row ``i`` of the window's order, as an index into its parts' rows laid end to end."""
        return _window_order(self.seed, self.index, self.rows)


@functools.lru_cache(maxsize=64)
def _window_order(seed: int | None, index: int, rows: int) -> np.ndarray:
    if seed is None:
        return np.arange(rows)
    order = _generator(seed, index).permutation(rows)
    order.flags.writeable = False  # shared by every batch cut from the window
    return order


def shuffled_parts(parts: Sequence[Part], seed: int) -> list[Part]:
    """The blocks of a materialized dataset in the random order of a pass (``seed``: the pass's)."""
    return [parts[i] for i in _generator(seed).permutation(len(parts))]


def window_least_rows(index: int, window_rows: int) -> int:
    """The rows window ``index`` holds at least: ``window_rows / 16`` for the first, doubling up to ``window_rows``
    (the first batch waits for a block or so, not for a whole window of blocks)."""
    return min(window_rows, max(1, window_rows // 16) << min(index, 40))


def windows(parts: Iterable[Part], window_rows: int, seed: int | None = None) -> Iterator[Window]:
    """The pass's windows, as its blocks come (dataset order): each at least :func:`window_least_rows` rows but
    the last. ``seed``: the pass's shuffle seed (None: no shuffle). Empty parts are left out."""
    index = start = 0
    run: list[Part] = []
    rows = 0
    for part in parts:
        if part.rows <= 0:
            continue
        run.append(part)
        rows += part.rows
        if rows >= window_least_rows(index, window_rows):
            yield Window(index, start, rows, tuple(run), seed)
            index, start, run, rows = index + 1, start + rows, [], 0
    if run:
        yield Window(index, start, rows, tuple(run), seed)


# -- Intervals of the order -----------------------------------------------------------------------------------


class Intervals:
    """Disjoint, sorted half-open intervals ``[a, b)`` of positions (the rows a checkpoint says are trained)."""

    def __init__(self, spans: Iterable[Sequence[int]] = ()) -> None:
        merged: list[list[int]] = []
        for a, b in sorted((int(a), int(b)) for a, b in spans if b > a):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.spans: list[tuple[int, int]] = [(a, b) for a, b in merged]

    def __len__(self) -> int:
        return sum(b - a for a, b in self.spans)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Intervals) and self.spans == other.spans

    def __repr__(self) -> str:
        return f"Intervals({self.spans})"

    def union(self, other: Intervals) -> Intervals:
        return Intervals([*self.spans, *other.spans])

    def covers(self, a: int, b: int) -> bool:
        """Whether every position of ``[a, b)`` is in these intervals."""
        i = bisect.bisect_right(self.spans, (a, math.inf)) - 1
        return b <= a or (i >= 0 and self.spans[i][0] <= a and b <= self.spans[i][1])

    def to_list(self) -> list[list[int]]:
        return [[a, b] for a, b in self.spans]


class Rest:
    """``Q``: the positions of the order not in ``trained``, numbered ``0, 1, ...``; maps them back to positions."""

    def __init__(self, trained: Intervals) -> None:
        self.trained = trained
        self._gaps: list[tuple[int, int]] = []  # (first Q position, first position) of each gap, in order
        q = position = 0
        for a, b in trained.spans:
            if a > position:
                self._gaps.append((q, position))
                q += a - position
            position = b
        self._gaps.append((q, position))  # the last gap has no end

    def length(self, total: int) -> int:
        """``Q``'s length in an order of ``total`` positions."""
        return total - sum(min(b, total) - min(a, total) for a, b in self.trained.spans)

    def positions(self, q: int, end: int) -> list[tuple[int, int]]:
        """The positions ``[a, b)`` of ``Q``'s ``q .. end``, in order."""
        out: list[tuple[int, int]] = []
        i = bisect.bisect_right(self._gaps, (q, math.inf)) - 1
        while q < end:
            gap_q, gap_position = self._gaps[i]
            gap_end = self._gaps[i + 1][0] if i + 1 < len(self._gaps) else math.inf
            stop = min(end, gap_end)
            out.append((gap_position + q - gap_q, gap_position + stop - gap_q))
            q, i = stop, i + 1
        return out

    def position(self, q: int) -> int:
        return self.positions(q, q + 1)[0][0]


# -- The deal -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DealSpec:
    """``world`` ranks, ``batch`` rows a batch, pieces growing to ``cap`` rows, ``mode`` one of :data:`MODES`."""

    world: int
    batch: int
    cap: int
    mode: str

    def piece(self, k: int) -> int:
        """Rows each rank gets in round ``k`` unless it is the tail."""
        return min(max(self.cap, self.batch), self.batch << min(k, 40))


def rows_per_rank(total: int, world: int, rank: int, mode: str) -> int:
    """Rows a rank gets from a ``Q`` of ``total`` positions (drop: the same for every rank)."""
    return total // world + (0 if mode == "drop" else int(rank < total % world))


def batches_per_rank(total: int, spec: DealSpec, rank: int) -> int:
    """Batches a rank gets from a ``Q`` of ``total`` positions: the same on every rank in training (drop: whole
    batches only; pad: enough for the rank with most rows), and evaluation's last batch may be short."""
    if spec.mode == "drop":
        return rows_per_rank(total, spec.world, rank, "drop") // spec.batch
    if spec.mode == "pad":
        return math.ceil(math.ceil(total / spec.world) / spec.batch)
    return math.ceil(rows_per_rank(total, spec.world, rank, "eval") / spec.batch)


class Deal:
    """The rounds of one pass over ``Q``: each decided full or the tail once ``Q``'s length at least up to the
    round's end is known. ``total``: ``Q``'s length where known at the start, else learned by :meth:`decide`'s
    ``reach``. Thread-safe: a rank's fetching thread decides rounds while its training thread reads them."""

    def __init__(self, spec: DealSpec, total: int | None = None) -> None:
        self.spec = spec
        self.total = total
        self._rounds: list[tuple[int, int, bool]] = []  # (first Q position, piece rows, full)
        self._guard = threading.Lock()

    def decide(self, k: int, reach: Callable[[int], int | None] | None = None) -> tuple[int, int, bool]:
        """Round ``k`` as ``(start, piece, full)``. ``reach(q)``: None when ``Q`` has ``q`` positions, else
        ``Q``'s length (it may wait for the pass's rows); needed only while the length is unknown."""
        while True:
            with self._guard:
                if k < len(self._rounds):
                    return self._rounds[k]
                last = self._rounds[-1] if self._rounds else None
                if last is not None and not last[2]:
                    raise IndexError(f"round {k} is after the tail")
                j = len(self._rounds)
                start = last[0] + self.spec.world * last[1] if last else 0
                piece = self.spec.piece(j)
                end = start + self.spec.world * piece
                total = self.total
            if total is None:
                if reach is None:
                    raise LookupError(f"round {j} is not decided and Q's length is unknown")
                total = reach(end)
            with self._guard:
                if total is not None and self.total is None:
                    self.total = total
                if len(self._rounds) == j:
                    self._rounds.append((start, piece, total is None or total >= end))

    def rank_rows(self, rank: int) -> int | None:
        """Rows the rank gets in the pass, once ``Q``'s length is known."""
        return None if self.total is None else rows_per_rank(self.total, self.spec.world, rank, self.spec.mode)

    def stream(self, rank: int, first: int, last: int, reach: Callable[[int], int | None] | None = None):
        """``Q``'s ``[a, b)`` holding rows ``first .. last`` of the rank's stream (its pieces end to end),
        clipped to the rows the rank gets."""
        out: list[tuple[int, int]] = []
        offset = k = 0
        while offset < last:
            try:
                start, piece, full = self.decide(k, reach)
            except IndexError:
                break
            if full:
                a, rows = start + rank * piece, piece
            else:
                remaining = (self.total or 0) - start
                quota, extra = divmod(remaining, self.spec.world)
                rows = quota + (0 if self.spec.mode == "drop" else int(rank < extra))
                a = start + rank * quota + (0 if self.spec.mode == "drop" else min(rank, extra))
            lo, hi = max(first, offset), min(last, offset + rows)
            if hi > lo:
                out.append((a + lo - offset, a + hi - offset))
            offset += rows
            k += 1
            if not full:
                break
        return out

    def trained(self, steps: int, rest: Rest, reach: Callable[[int], int | None] | None = None) -> Intervals:
        """The positions every rank's first ``steps`` batches trained (padding excluded); ``reach``: as for
        :meth:`decide`, for rounds not decided yet."""
        spans = []
        for rank in range(self.spec.world):
            for a, b in self.stream(rank, 0, steps * self.spec.batch, reach):
                spans += rest.positions(a, b)
        return Intervals(spans)
