"""The data benchmark's rows: its sizes, the generated images and their preprocessing, the Ray Data pipeline.

numpy only: this is what Ray Data's worker processes import to run :func:`preprocess_batch` (a module that
imports Lightning, as :mod:`benchmarks.data_driver` does, would cost each of them ~5 s on 2 cores before its
first block).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks import JsonSpec

# ImageNet's per-channel mean and standard deviation: the normalization of the preprocessing.
_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)[:, None, None]
_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)[:, None, None]


@dataclass
class DataSpec(JsonSpec):
    """The sizes of one data-benchmark run; sent as JSON to each driver process."""

    workers: int = 2
    # Rows of the one training epoch of a fit; a step is one batch of `batch_size` rows on every worker.
    rows: int = 12288
    batch_size: int = 64
    # Steps left out of the throughput and the idle time (the pipelines ramping up).
    warmup: int = 10
    # A row: a generated uint8 image channels x image x image, randomly cropped to crop x crop, maybe flipped,
    # normalized to float32, then `work` passes of a 3x3 blur (what makes a row cost ~1.5 ms on one core).
    channels: int = 3
    image: int = 64
    crop: int = 56
    work: int = 24
    classes: int = 10
    # Rows per block of the Ray Data pipeline (`range(rows, override_num_blocks=rows // block_rows)`), as if read
    # from files of that many images: left to itself, `range` makes a few blocks per CPU (here 4 of 3072 rows,
    # 5 s of preprocessing each before their first row is out).
    block_rows: int = 256
    # Preprocessing processes per training worker: the plain DataLoader's `num_workers`; the harness's Ray
    # cluster offers as many CPUs beyond the training workers' to Ray Data's tasks.
    loader_workers: int = 1
    # The data ready before the fit (the transport alone): the Ray Data pipeline materialized in the driver, the
    # DataLoader's rows computed in each rank's `setup`.
    ready: bool = False
    seed: int = 0
    # Set by the harness: the Ray cluster to connect to and a directory for the ranks' files and Ray Train.
    ray_address: str = ""
    scratch: str = ""
    # Tiny sizes (the smoke test's): what only costs time goes (`benchmarks.measure.measurement_main`).
    smoke: bool = False

    @classmethod
    def tiny(cls) -> DataSpec:
        """Sizes for the smoke test: every code path, seconds of compute."""
        return cls(rows=2 * 16 * 6, batch_size=16, warmup=2, image=16, crop=12, work=2, block_rows=16, smoke=True)

    @property
    def steps(self) -> int:
        """Optimizer steps of the fit: the epoch's whole steps."""
        return self.rows // (self.workers * self.batch_size)


# -- The preprocessing: the same per row in every contender ------------------------------------------------


def preprocess_row(i: int, spec: DataSpec) -> np.ndarray:
    """Row ``i``'s image, ready for the model: float32 channels x crop x crop.

    "Decode": a uint8 image generated from (seed, i), as if read from storage; then a random crop, a random
    horizontal flip (both drawn from the same generator: the same for a row in every contender), the
    normalization, and ``spec.work`` passes of a 3x3 box blur (the rest of a real augmentation's cost)."""
    rng = np.random.default_rng([spec.seed, i])
    raw = rng.integers(0, 256, (spec.channels, spec.image, spec.image), dtype=np.uint8)
    y, x = rng.integers(0, spec.image - spec.crop + 1, 2)
    image = raw[:, y : y + spec.crop, x : x + spec.crop]
    if rng.random() < 0.5:
        image = image[:, :, ::-1]
    out = (image.astype(np.float32) * (1 / 255) - _MEAN[: spec.channels]) / _STD[: spec.channels]
    for _ in range(spec.work):
        p = np.pad(out, ((0, 0), (1, 1), (1, 1)), mode="edge")
        out = (p[:, :-2, 1:-1] + p[:, 2:, 1:-1] + p[:, 1:-1, :-2] + p[:, 1:-1, 2:] + p[:, 1:-1, 1:-1]) * 0.2
    return np.ascontiguousarray(out, dtype=np.float32)


def label(i: int, spec: DataSpec) -> int:
    return i % spec.classes


def preprocess_batch(batch: dict[str, np.ndarray], spec_json: str) -> dict[str, np.ndarray]:
    """Ray Data's ``map_batches`` function: rows of ``id`` to rows of ``image`` and ``label``, row by row."""
    spec = DataSpec.from_json(spec_json)
    ids = [int(i) for i in batch["id"]]
    return {
        "image": np.stack([preprocess_row(i, spec) for i in ids]),
        "label": np.array([label(i, spec) for i in ids], dtype=np.int64),
    }


def image_dataset(spec: DataSpec) -> Any:
    """The Ray Data pipeline of both Ray Data contenders: ``range(rows)`` in blocks of ``block_rows``, then
    :func:`preprocess_batch` as ``map_batches`` (Ray Data's defaults otherwise: a task per block, 1 CPU each).
    With ``spec.ready``, that pipeline materialized (once per driver process)."""
    import ray.data

    # Progress bars off for both Ray Data contenders (they would print from the actor that runs the pipeline).
    ray.data.DataContext.get_current().enable_progress_bars = False
    if spec.ready:
        return _materialized(spec.to_json())
    fn = functools.partial(preprocess_batch, spec_json=spec.to_json())
    blocks = max(1, spec.rows // spec.block_rows)
    return ray.data.range(spec.rows, override_num_blocks=blocks).map_batches(fn, batch_format="numpy")


@functools.lru_cache(maxsize=1)
def _materialized(spec_json: str) -> Any:
    spec = DataSpec.from_json(spec_json)
    spec.ready = False
    return image_dataset(spec).materialize()
