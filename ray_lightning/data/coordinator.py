"""The coordinator: one Ray actor per dataset of a call, which runs the dataset's pipeline and hands the ranks
*windows* (block references, row counts and a seed: metadata), never rows.

Each pass (a training epoch, a validation run...) is one execution of the pipeline (``iter_internal_ref_bundles``,
as Ray Data's own ``SplitCoordinator`` under ``streaming_split``): Ray Data's tasks produce the blocks wherever
the cluster has free CPUs, the coordinator cuts the stream of block references into windows (:mod:`.order`) as
they come, and each rank fetches the blocks of the windows its pieces fall in straight from the object store and
cuts its own batches (:mod:`.loader`). Growth: the coordinator's work is per block (a few references and
integers), none per byte or per row; its memory is the windows the ranks have not passed yet, plus, for a fit
that may restart, the ones a restart would need (within ``retain_bytes``).

Decisions:

* **Ahead, within a bound.** A pass's pipeline starts when a rank first asks for it and runs ahead of the ranks
  until ``ahead_bytes`` of windows wait for them (a tenth of the object store): Ray Data's executor stops when its
  output is not taken, so a pipeline kept one window ahead of the ranks left the CPUs idle half the time
  (measured: 1.1 of 2 cores busy against 1.6).
* **Skip by metadata.** A resumed pass is told which positions are trained; windows wholly inside them are
  dropped as they come, never fetched by anyone. Where the blocks must be computed to be known (a ``map_batches``
  pipeline) the skip runs in Ray Data's parallel tasks; the ranks' batch timeout does not count it.
* **A restart reads from memory.** With ``retain_bytes``, the windows a rank passed are kept until a checkpoint
  covers them, so a restart in the same call serves its resumed epoch from the object store at once, wherever in
  the epoch it failed; beyond the budget (or once another epoch began) it executes the pipeline again, skipping.
* **Released at once.** A window every rank of the pass has passed (and no restart needs) drops its references,
  so an epoch leaves nothing in the object store.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ray_lightning import _ray
from ray_lightning.data.order import Intervals, Part, Window, shuffled_parts, windows

log = logging.getLogger(__name__)

WAIT_S = 2.0  # the longest one call waits before saying the pass is still going (the rank asks again)
TRAINING_PASSES_KEPT = 2  # a restart may resume the epoch before the one that started last


@dataclass(frozen=True)
class PassSpec:
    """How the coordinator orders a pass: ``shuffle`` (``"local"``, ``"full"`` or None) with ``seed``, windows of
    at least ``window_rows`` rows."""

    shuffle: str | None
    seed: int | None
    window_rows: int


@dataclass(frozen=True)
class Pending:
    """The window is not there yet: ``skipped`` rows of trained windows dropped so far (a resume's skip)."""

    skipped: int


@dataclass(frozen=True)
class End:
    """The pass has ``total`` positions, all before the one asked for."""

    total: int


@dataclass
class _Entry:
    start: int
    rows: int
    window: Window | None  # None once released
    size_bytes: int


class _Pass:
    """One execution of the pipeline, its windows as they come, and which of them are still held."""

    def __init__(self, dataset: Any, spec: PassSpec, retain_bytes: int, ahead_bytes: int) -> None:
        self.spec = spec
        self._dataset = dataset
        self._retain_bytes = retain_bytes
        self._ahead_bytes = ahead_bytes
        self._cond = threading.Condition()
        self._entries: list[_Entry] = []
        self._starts: list[int] = []
        self._produced = 0
        self._skipped = 0
        self._demand = 0
        self._released = 0  # entries before it are all released
        self.total: int | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self.attempt = ""
        self.world = 0
        self._base = Intervals()
        self._kept = Intervals()  # positions a restart no longer needs (trained before, or checkpointed)
        self._lows: dict[int, int] = {}

    # -- who reads it --------------------------------------------------------------------------------------------

    def attach(self, attempt: str, world: int, base: Intervals) -> bool:
        """This attempt's ranks read the pass from ``base`` on; False when a window they need is gone."""
        with self._cond:
            gone = [e for e in self._entries if e.window is None and not base.covers(e.start, e.start + e.rows)]
            if gone:
                return False
            self.attempt, self.world, self._base = attempt, world, base
            self._kept = self._kept.union(base)
            self._lows = {}
            self._release()
            return True

    def checkpointed(self, trained: Intervals) -> None:
        with self._cond:
            self._kept = self._kept.union(trained)
            self._release()

    def passed(self, rank: int, low: int) -> None:
        """Rank ``rank`` needs no position before ``low`` any more."""
        with self._cond:
            self._lows[rank] = max(low, self._lows.get(rank, 0))
            self._release()

    def _release(self) -> None:
        """Drop the windows every rank has passed, unless a restart could need them (within the budget)."""
        low = min((self._lows.get(r, 0) for r in range(self.world)), default=0)
        kept: list[_Entry] = []  # passed, held for a restart only
        for entry in self._entries[self._released :]:
            if entry.window is None:
                continue
            end = entry.start + entry.rows
            if self._base.covers(entry.start, end):
                entry.window = None
            elif end <= low:
                if self._retain_bytes <= 0 or self._kept.covers(entry.start, end):
                    entry.window = None
                else:
                    kept.append(entry)
        held = sum(e.size_bytes for e in kept)
        for entry in kept:  # the oldest first: the least likely to be needed
            if held <= self._retain_bytes:
                break
            held -= entry.size_bytes
            entry.window = None
        while self._released < len(self._entries) and self._entries[self._released].window is None:
            self._released += 1

    def finished(self, rank: int) -> bool:
        """Rank ``rank`` read the whole pass; True once every rank has."""
        self.passed(rank, 1 << 62)
        with self._cond:
            return len(self._lows) == self.world and all(low >= 1 << 62 for low in self._lows.values())

    # -- what it holds -------------------------------------------------------------------------------------------

    def find(self, position: int, want_window: bool) -> Window | End | Pending | None:
        """The window holding ``position`` (or None if only its existence was asked), the pass's end, or Pending
        after waiting up to :data:`WAIT_S`."""
        deadline = time.monotonic() + WAIT_S
        with self._cond:
            if position + 1 > self._demand:
                self._demand = position + 1
                self._start()
                self._cond.notify_all()
            while True:
                if self._error is not None:
                    raise self._error
                if position < self._produced:
                    if not want_window:
                        return None
                    entry = self._entries[_index(self._starts, position)]
                    if entry.window is None:
                        raise LookupError(f"position {position}'s window was released")
                    return entry.window
                if self.total is not None:
                    return End(self.total)
                left = deadline - time.monotonic()
                if left <= 0:
                    return Pending(self._skipped)
                self._cond.wait(left)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for entry in self._entries:
                entry.window = None
            self._cond.notify_all()

    def held(self) -> tuple[int, int]:
        """(windows, bytes) still referenced."""
        with self._cond:
            live = [e for e in self._entries if e.window is not None]
            return len(live), sum(e.size_bytes for e in live)

    # -- the producer --------------------------------------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, name="ray_lightning-data-pass", daemon=True)
            self._thread.start()

    def _produce(self) -> None:
        made = windows(self._parts(), self.spec.window_rows, self._row_seed())
        try:
            for window in made:
                with self._cond:
                    while not self._closed and self._ahead():
                        self._cond.wait()
                    if self._closed:
                        return
                    self._add(window)
            with self._cond:
                self.total = self._produced
                self._cond.notify_all()
        except BaseException as error:  # noqa: BLE001 - the pipeline's failure goes to every rank that asks
            with self._cond:
                self._error = error
                self._cond.notify_all()
        finally:
            made.close()  # a pass closed early stops its execution
            # Each execution leaves reference cycles holding objects it put (the read tasks, the map function):
            # without a collection they pile up in the object store, epoch after epoch (tests/test_data.py counts
            # them). Since the coordinator froze what it imported, a collection costs a few ms.
            gc.collect()

    def _ahead(self) -> bool:
        """Whether the pipeline is far enough ahead of the ranks to wait: a window past what they asked for, and
        ``ahead_bytes`` of windows they have not passed. The executor stops when its output is not taken (Ray
        Data's backpressure), so a tighter bound leaves the cluster's CPUs idle while the ranks train."""
        if self._produced < self._demand + self.spec.window_rows:
            return False
        low = min((self._lows.get(r, 0) for r in range(self.world)), default=0)
        live = self._entries[self._released :]
        return sum(e.size_bytes for e in live if e.window is not None and e.start + e.rows > low) >= self._ahead_bytes

    def _add(self, window: Window) -> None:
        size = sum(p.size_bytes for p in window.parts)
        entry = _Entry(window.start, window.rows, window, size)
        if self._base.covers(window.start, window.end):
            entry.window = None  # a resume's trained rows: skipped without anyone fetching them
            self._skipped += window.rows
        self._entries.append(entry)
        self._starts.append(window.start)
        self._produced = window.end
        self._release()
        self._cond.notify_all()

    def _row_seed(self) -> int | None:
        return self.spec.seed if self.spec.shuffle == "local" else None

    def _parts(self) -> Iterator[Part]:
        spec, dataset = self.spec, self._dataset
        if spec.shuffle == "full" and spec.seed is not None:
            dataset = dataset.random_shuffle(seed=spec.seed)
        parts = (Part(*found) for found in _ray.data.block_parts(dataset))
        if spec.shuffle == "local" and spec.seed is not None and _ray.data.is_materialized(dataset):
            # Its blocks all exist already: a random order over all of them costs no wait.
            return iter(shuffled_parts(list(parts), spec.seed))
        return parts


def _index(starts: list[int], position: int) -> int:
    import bisect

    return bisect.bisect_right(starts, position) - 1


class Coordinator:
    """The actor (``ray.remote(Coordinator)``): the passes of one dataset in one call.

    ``exclude``: the training workers' resources (``{"cpu": ..., "gpu": ...}``), which Ray Data's executor leaves
    out of what it plans its tasks on. ``retain_bytes``: what a fit that may restart keeps for it (0: nothing).
    ``ahead_bytes``: how far a pass's pipeline may run ahead of its ranks.
    """

    def __init__(self, dataset: Any, name: str, exclude: dict[str, float], retain_bytes: int, ahead_bytes: int) -> None:
        from ray.data import DataContext

        DataContext.get_current().enable_progress_bars = False  # this actor's own: it would print on the driver
        _ray.data.prepare_context(dataset, exclude)
        # What this process imported stays: out of the collections each pass's end runs (:meth:`_Pass._produce`),
        # which then look at what the passes made only (a few ms instead of ~0.2 s).
        gc.collect()
        gc.freeze()
        self._dataset = dataset
        self._name = name
        self._retain_bytes = retain_bytes
        self._ahead_bytes = ahead_bytes
        self._passes: dict[tuple, _Pass] = {}
        self._guard = threading.Lock()
        self._cpu_start = time.process_time()

    def open(self, key: tuple, attempt: str, world: int, spec: PassSpec, base: list) -> None:
        """Rank calls at a pass's start (each rank sends the same); a training pass (``key[0] == "train"``) of
        an earlier attempt is taken over where its windows allow."""
        trained = Intervals(base)
        with self._guard:
            found = self._passes.get(key)
            if found is not None and found.attempt == attempt:
                return
            if found is not None and (found.spec != spec or not found.attach(attempt, world, trained)):
                found.close()
                found = None
            if found is None:
                retain = self._retain_bytes if key[0] == "train" else 0
                found = _Pass(self._dataset, spec, retain, self._ahead_bytes)
                found.attach(attempt, world, trained)
                self._passes[key] = found
            self._forget_old(key, attempt)

    def _forget_old(self, key: tuple, attempt: str) -> None:
        training = sorted(k for k in self._passes if k[0] == "train")
        for old in list(self._passes):
            stale_eval = old[0] != "train" and self._passes[old].attempt != attempt
            if stale_eval or (old[0] == "train" and old in training[:-TRAINING_PASSES_KEPT]):
                self._passes.pop(old).close()

    def window(self, key: tuple, attempt: str, position: int, rank: int, low: int) -> Window | End | Pending:
        """The window holding ``position``; ``low``: the first position this rank still needs."""
        found = self._pass(key, attempt)
        found.passed(rank, low)
        return found.find(position, True)  # type: ignore[return-value]

    def reach(self, key: tuple, attempt: str, position: int) -> bool | End | Pending:
        """True when the pass has ``position``, else its :class:`End` or :class:`Pending`."""
        found = self._pass(key, attempt).find(position, False)
        return True if found is None else found

    def finished(self, key: tuple, attempt: str, rank: int) -> None:
        """Rank ``rank`` read the whole pass. An evaluation pass every rank read is forgotten; a training pass is
        kept for a restart that resumes its epoch."""
        with self._guard:
            found = self._passes.get(key)
            if found is not None and found.attempt == attempt and found.finished(rank) and key[0] != "train":
                self._passes.pop(key).close()

    def checkpointed(self, key: tuple, trained: list) -> None:
        """Rank 0 saved a checkpoint holding these trained positions: a restart will not need them."""
        found = self._passes.get(key)
        if found is not None:
            found.checkpointed(Intervals(trained))

    def _pass(self, key: tuple, attempt: str) -> _Pass:
        found = self._passes.get(key)
        if found is None or found.attempt != attempt:
            raise RuntimeError(f"RayDataModule: the {self._name} pass {key} is not open for attempt {attempt}")
        return found

    def stats(self) -> dict[str, Any]:
        """What the coordinator holds and the CPU time it spent (tests and benchmarks read it)."""
        held = [p.held() for p in self._passes.values()]
        return {
            "passes": len(self._passes),
            "windows": sum(h[0] for h in held),
            "bytes": sum(h[1] for h in held),
            "cpu_s": time.process_time() - self._cpu_start,
        }
