"""What every rank of a storage-benchmark fit records (:class:`CheckpointProbe`, from :mod:`benchmarks.storage_driver`):
how long each epoch-end checkpoint held the training thread, its peak RSS and RSS timeline, the step it started at."""

from __future__ import annotations

import os
import resource
import threading
import time
from typing import Any

from benchmarks import write_whole
from benchmarks.sharded_measure import MemorySampler
from benchmarks.workload import pl

# Ray Train's callback and ray_lightning's recovery callback: the epoch-end checkpoints the probe times.
_CHECKPOINT_CALLBACKS = ("RecoveryCheckpoints", "RayTrainReportCallback")


def _rss_mb() -> float:
    """This process's resident memory now, MB (0 where /proc is absent)."""
    return MemorySampler.sample().get("VmRSS", 0.0)


def fixed_mmap_threshold(threshold: int = 1 << 20) -> bool:
    """glibc: every allocation of ``threshold`` bytes or more its own mapping, returned to the OS when freed.

    By default glibc raises that threshold (up to 32 MB) each time a mapped block is freed, after which
    tensors of a few MB come from its heaps, which keep freed memory: a process's peak RSS then depends on
    how its allocations happened to interleave (the same fit's ranks differed by 0.5-0.9 GB from run to run).
    With the threshold fixed, RSS follows the memory in use. Where glibc is absent, nothing changes (False).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, threshold))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def coarse(timeline: list[tuple[float, float]], period_s: float = 1.0) -> list[tuple[float, float]]:
    """The highest sample of every ``period_s`` of a (time, RSS) timeline: where the peak was, in a small file."""
    kept: dict[int, tuple[float, float]] = {}
    for at, rss in timeline:
        slot = int(at // period_s)
        if slot not in kept or rss > kept[slot][1]:
            kept[slot] = (at, rss)
    return [kept[slot] for slot in sorted(kept)]


def _wait_for_uploads() -> None:
    from ray_lightning.home import storage

    storage.uploads().wait()


def _uploads_blocked_s() -> float:
    from ray_lightning.home import storage

    return storage.uploads().blocked_s


class CheckpointProbe(pl.Callback):
    """In every rank: how long each epoch-end checkpoint held the training thread, the peak RSS, the start step.

    The checkpoint is taken by another callback (ray_lightning's ``RecoveryCheckpoints``, Ray Train's
    ``RayTrainReportCallback``) in its ``on_train_epoch_end``: at ``on_train_start`` the probe wraps that
    hook with a timer. ``sync``: the wrapped hook then waits for the upload it started, a synchronous save.
    ``hold_s``: rank 0 waits at the second epoch's start (the harness kills the driver meanwhile).
    ``exact_memory``: glibc's mmap threshold fixed at ``setup`` (:func:`fixed_mmap_threshold`), for the memory cases.
    At ``teardown`` (after waiting for the last upload, where the ranks upload) it writes
    ``<prefix>.rank<N>.json``.
    """

    def __init__(
        self, prefix: str, sync: bool, uploads: bool, hold_s: float | None = None, exact_memory: bool = False
    ) -> None:
        self.prefix, self.sync, self.uploads, self.hold_s = prefix, sync, uploads, hold_s
        self.exact_memory = exact_memory
        self.checkpoints: list[dict[str, Any]] = []
        self.start_step: int | None = None
        self.rss_at_start = 0.0
        self.wrapped: list[str] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.exact_memory:
            fixed_mmap_threshold()
        self._timeline: list[tuple[float, float]] = []
        self._sampling = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._sampling.wait(0.1):
            self._timeline.append((time.time(), _rss_mb()))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = trainer.global_step
        self.rss_at_start = _rss_mb()
        for callback in trainer.callbacks:
            if type(callback).__name__ in _CHECKPOINT_CALLBACKS:
                self._wrap(callback)

    def _wrap(self, callback: Any) -> None:
        original = callback.on_train_epoch_end

        def timed(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            at, started = time.time(), time.perf_counter()
            original(trainer, pl_module)
            call_s = time.perf_counter() - started
            if self.sync:
                _wait_for_uploads()
            blocked_s = time.perf_counter() - started
            record = {"global_step": trainer.global_step, "at": at, "call_s": call_s, "blocked_s": blocked_s}
            self.checkpoints.append(record)

        callback.on_train_epoch_end = timed  # Lightning calls the hook it finds on the instance
        self.wrapped.append(type(callback).__name__)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.hold_s is None or trainer.current_epoch != 1 or trainer.global_rank != 0:
            return
        # The first epoch's checkpoint is being uploaded: wait here until the harness, which saw it complete in
        # the bucket, kills this driver (its workers go with it). Bounded: then the fit goes on and the harness,
        # which found no marker, records a failure.
        deadline = time.monotonic() + self.hold_s
        while time.monotonic() < deadline:
            time.sleep(0.1)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        waited = _uploads_blocked_s() if self.uploads else None  # before the wait below adds to it
        if self.uploads:
            _wait_for_uploads()  # the fit waits for the last upload right after; its memory counts
        self._sampling.set()
        self._sampler.join()
        record = {
            "timeline": coarse(self._timeline),
            "rank": trainer.global_rank,
            "pid": os.getpid(),
            # ru_maxrss: KiB on Linux, the high-water mark of this worker process.
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_at_train_start_mb": self.rss_at_start,
            "start_step": self.start_step,
            "final_step": trainer.global_step,
            "checkpoints": self.checkpoints,
            "wrapped": self.wrapped,
            "uploads_blocked_s": waited,
        }
        write_whole(f"{self.prefix}.rank{trainer.global_rank}.json", record)
