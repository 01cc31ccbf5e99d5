"""Ray Data's private ``Dataset._meta_count``: a dataset's row count where its metadata knows it, without
running the dataset (the public ``count()`` runs the whole pipeline when its metadata does not know).

``RayDataModule`` uses it for its loaders' length and its checks before the workers start; where the name is
gone the count is unknown (no length, the checks wait for the rows).
"""

from __future__ import annotations

from typing import Any

DATASET = "ray.data.dataset"
META_COUNT = "_meta_count"  # a method of ray.data.Dataset


def known_row_count(dataset: Any) -> int | None:
    """The dataset's row count if known without reading it, else None."""
    count = getattr(dataset, META_COUNT, None)
    try:
        return count() if callable(count) else None
    except Exception:  # noqa: BLE001 - a count the metadata cannot give is an unknown one
        return None
