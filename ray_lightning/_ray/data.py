"""What ``RayDataModule`` needs of Ray Data beyond its documented API, in one place.

* ``Dataset._meta_count`` (private): a dataset's row count where its metadata knows it, without running the
  dataset (the public ``count()`` runs the whole pipeline when its metadata does not know). Where the name is
  gone the count is unknown (no length, the checks wait for the rows).
* ``Dataset.iter_internal_ref_bundles`` (a DeveloperAPI, what Ray Data's ``SplitCoordinator`` reads): a pass's
  block references and metadata as the pipeline makes them, without fetching a block.
* ``ExecutionOptions.exclude_resources``: deprecated in Ray 2.60 ("removed after January 2027", in favour of
  label selectors, which need labelled nodes); set quietly until then. ``tests/test_ray_internals.py`` names it
  when it is gone.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

DATASET = "ray.data.dataset"
META_COUNT = "_meta_count"  # a method of ray.data.Dataset
REF_BUNDLES = "iter_internal_ref_bundles"  # a method of ray.data.Dataset
EXECUTION_OPTIONS = "ray.data"
EXCLUDE_RESOURCES = "exclude_resources"  # a property of ray.data.ExecutionOptions


def known_row_count(dataset: Any) -> int | None:
    """The dataset's row count if known without reading it, else None."""
    count = getattr(dataset, META_COUNT, None)
    try:
        return count() if callable(count) else None
    except Exception:  # noqa: BLE001 - a count the metadata cannot give is an unknown one
        return None


def is_materialized(dataset: Any) -> bool:
    """Whether every block of the dataset exists already (``materialize()``, ``from_items``, ``from_numpy``...)."""
    from ray.data.dataset import MaterializedDataset

    return isinstance(dataset, MaterializedDataset)


def prepare_context(dataset: Any, exclude: dict[str, float]) -> None:
    """The dataset's own execution settings for a pass read by ranks: blocks in dataset order, no progress bars
    (they would print from the coordinator's process), and ``exclude`` (the training workers' CPUs and GPUs) left
    out of what Ray Data plans its tasks on. A resource the user limited himself is left as he set it."""
    from ray.data import ExecutionResources

    dataset.context.execution_options.preserve_order = True
    dataset.context.enable_progress_bars = False
    options = dataset.context.execution_options
    limits = options.resource_limits
    amounts = {
        name: value for name, value in exclude.items() if value and getattr(limits, name, None) in (None, float("inf"))
    }
    if amounts:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            setattr(options, EXCLUDE_RESOURCES, ExecutionResources(**amounts))


def block_parts(dataset: Any) -> Iterator[tuple[Any, int, int, int]]:
    """The pass's blocks as ``(ref, first row, rows, bytes)``, in dataset order, as the pipeline makes them (one
    execution of the dataset). A block whose metadata has no row count is counted where it lives."""
    import ray

    for bundle in getattr(dataset, REF_BUNDLES)():
        for entry, piece in zip(bundle.blocks, bundle.slices):
            meta = entry.metadata
            if piece is not None:
                offset, rows = piece.start_offset, piece.end_offset - piece.start_offset
            else:
                offset, rows = 0, meta.num_rows
                if rows is None:
                    rows = ray.get(_count_rows.remote(entry.ref))
            size = meta.size_bytes or 0
            if meta.num_rows and rows != meta.num_rows:
                size = size * rows // meta.num_rows
            yield entry.ref, offset, rows, size


def _remote_count():
    import ray

    @ray.remote(num_cpus=0)
    def count_rows(block: Any) -> int:
        from ray.data.block import BlockAccessor

        return BlockAccessor.for_block(block).num_rows()

    return count_rows


class _Lazy:
    """``ray.remote`` made on first use (importing this module must not need a Ray session)."""

    def __init__(self, make: Any) -> None:
        self._make, self._made = make, None

    def remote(self, *args: Any) -> Any:
        if self._made is None:
            self._made = self._make()
        return self._made.remote(*args)


_count_rows = _Lazy(_remote_count)
