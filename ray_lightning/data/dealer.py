"""The dealer: one Ray actor per dataset of a call, which cuts each pass over the dataset into batches in one
fixed order and deals global batch ``g`` to rank ``g % world_size``.

Why one order, dealt: a pass's order depends only on the dataset, the run's seed and the epoch, never on the
number of workers or on timing, so a checkpoint can say "the first N rows of epoch E are trained" and a resume
on any number of workers continues at row N (``RayDataModule.state_dict``); and the dealer decides where a
training epoch ends for every rank at once, so ranks always get the same number of batches (DDP never waits
on a rank that ran out). Rows travel as Arrow tables through Ray's object store, straight from the dealer's
``ray.put`` to the rank: the dealer holds only the batches dealt and not yet fetched.

The dataset's preprocessing (``map_batches``...) runs as Ray Data tasks that Ray schedules on any node with
free CPUs: the dealer is created outside the training workers' placement group, so are its tasks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

# Rows per chunk read from a locally shuffled pass: a constant, so a pass's order does not depend on the
# batch size or the number of workers (a resume may change both).
SHUFFLE_CHUNK_ROWS = 256
MASK = "mask"  # the column a padded training batch carries: True for real rows, False for padding
PASSES_KEPT = 2  # a rank may start the next pass while another still finishes this one (evaluation)


@dataclass(frozen=True)
class PassSpec:
    """How a loader cuts passes: ``training`` (whole steps of one batch per rank; the rest is dropped or
    padded by ``last_batch``) or evaluation (every row once; the last batch may be short, so a rank may get one
    batch fewer). ``shuffle``: ``"local"``, ``"full"`` or None."""

    batch_size: int
    training: bool
    last_batch: str = "drop"
    shuffle: str | None = None
    shuffle_buffer: int = 0


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of ``epoch``: different every epoch, the same in every rerun with the same seed."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def plan(dataset: Any, spec: PassSpec, seed: int | None) -> tuple[Any, dict[str, Any]]:
    """The pass's dataset and the ``iter_batches`` arguments that read it in its one order."""
    dataset.context.execution_options.preserve_order = True
    if spec.shuffle == "full" and seed is not None:
        return dataset.random_shuffle(seed=seed), {"batch_size": None}
    if spec.shuffle == "local" and seed is not None:
        read = {"batch_size": SHUFFLE_CHUNK_ROWS, "local_shuffle_buffer_size": spec.shuffle_buffer,
                "local_shuffle_seed": seed}  # fmt: skip
        return dataset.randomize_block_order(seed=seed), read
    return dataset, {"batch_size": None}


class _Pass:
    """One pass over the dataset: its rows in order, cut into global batches as ranks ask for them."""

    def __init__(self, dataset: Any, spec: PassSpec, world_size: int, seed: int | None, skip_rows: int) -> None:
        import pyarrow as pa

        self._pa = pa
        self.spec = spec
        self.world_size = world_size
        data, read = plan(dataset, spec, seed)
        self._chunks = iter(data.iter_batches(batch_format="pyarrow", prefetch_batches=2, **read))
        self._buffer: list[Any] = []
        self._buffered = 0
        self._ended = False
        self._head: Any = None  # the pass's first rows: what pads its last training step
        self._ready: dict[int, Any] = {}  # global batch -> [ObjectRef of its table]
        self._next = 0  # the next global batch to cut
        self._last: int | None = None  # the number of global batches, once the pass has ended
        self.rows = 0  # rows read so far, skipped ones included
        self._skip(skip_rows)

    def _read(self) -> bool:
        """Buffer one more chunk; False once the pass has no more rows."""
        if self._ended:
            return False
        chunk = next(self._chunks, None)
        if chunk is None:
            self._ended = True
            return False
        if chunk.num_rows:
            self._buffer.append(chunk)
            self._buffered += chunk.num_rows
            self.rows += chunk.num_rows
        return True

    def _take(self, n: int) -> Any:
        table = self._pa.concat_tables(self._buffer) if len(self._buffer) > 1 else self._buffer[0]
        taken, rest = table.slice(0, n), table.slice(n)
        self._buffer, self._buffered = ([rest] if rest.num_rows else []), rest.num_rows
        return taken

    def _skip(self, rows: int) -> None:
        while rows > 0 and (self._buffered or self._read()):
            if self._buffered:
                n = min(rows, self._buffered)
                self._take(n)
                rows -= n

    def _fill(self, rows: int) -> int:
        while self._buffered < rows and self._read():
            pass
        return min(rows, self._buffered)

    def batch(self, g: int) -> list[Any] | None:
        """Global batch ``g`` ([a reference to its table]), or None where the pass has no such batch."""
        while g >= self._next and (self._last is None or self._next < self._last):
            self._cut()
        if self._last is not None and g >= self._last:
            return None
        return [self._ready.pop(g)]

    def _cut(self) -> None:
        """Cut the next global batch (evaluation) or the next step's ``world_size`` batches (training)."""
        import ray

        spec = self.spec
        want = spec.batch_size * (self.world_size if spec.training else 1)
        have = self._fill(want)
        if spec.training and have < want and not (spec.last_batch == "pad" and have > 0):
            self._last = self._next  # drop: the step is incomplete, so no rank gets one
            return
        if not spec.training and have == 0:
            self._last = self._next
            return
        rows = self._take(have)
        if self._head is None:
            self._head = rows.slice(0, want)
        if spec.training and spec.last_batch == "pad":
            rows = self._masked(rows, want)
        for i in range(0, rows.num_rows, spec.batch_size):
            self._ready[self._next] = ray.put(rows.slice(i, spec.batch_size))
            self._next += 1
        if have < want:
            self._last = self._next

    def _masked(self, rows: Any, want: int) -> Any:
        """``rows`` with a mask column, padded to ``want`` rows with the pass's first rows (masked out)."""
        pa = self._pa
        real = rows.num_rows
        parts = [rows.append_column(MASK, pa.array(np.ones(real, dtype=bool)))]
        missing = want - real
        while missing > 0:
            pad = self._head.slice(0, missing)
            parts.append(pad.append_column(MASK, pa.array(np.zeros(pad.num_rows, dtype=bool))))
            missing -= pad.num_rows
        return pa.concat_tables(parts)


class Dealer:
    """The actor (``ray.remote(Dealer)``): passes of one dataset, keyed by the attempt and the pass index."""

    def __init__(self, dataset: Any, spec: PassSpec) -> None:
        from ray.data import DataContext

        context = DataContext.get_current()
        context.execution_options.preserve_order = True
        # A pass per epoch: Ray Data's progress bars would print from this actor on the driver each time.
        context.enable_progress_bars = False
        self._dataset = dataset
        self._spec = spec
        self._passes: dict[tuple[str, int], _Pass] = {}
        self._guard = threading.Lock()

    def batch(self, attempt: str, index: int, start: tuple[int, int | None, int], g: int) -> list[Any] | None:
        """Global batch ``g`` of pass ``index`` of ``attempt``, or None past the pass's end. ``start``: the pass's
        ``(world_size, seed, skip_rows)``, taken from its first caller (every rank sends the same)."""
        with self._guard:
            key = (attempt, index)
            current = self._passes.get(key)
            if current is None:
                # A new attempt or pass: the passes of earlier attempts and old passes are done with.
                for old in [k for k in self._passes if k[0] != attempt or k[1] <= index - PASSES_KEPT]:
                    del self._passes[old]
                current = self._passes[key] = _Pass(self._dataset, self._spec, *start)
            return current.batch(g)

    def rows_read(self, attempt: str, index: int) -> int:
        """Rows the pass has read so far (skipped ones included): 0 for a pass not started."""
        with self._guard:
            found = self._passes.get((attempt, index))
            return found.rows if found else 0
