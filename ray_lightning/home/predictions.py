"""Every rank's predictions, recorded with their dataset indices and put back into dataset order on the driver."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from ray_lightning import namespaces

if TYPE_CHECKING:
    import pytorch_lightning as pl


class PredictionRecorder(*namespaces.every("callbacks.BasePredictionWriter")):
    """Added to each worker's Trainer while predicting: keeps every batch's prediction with its dataset indices.

    Nothing is kept with ``trainer.predict(..., return_predictions=False)``.
    """

    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.records: list[tuple[int, list[int], Any]] = []

    @override
    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: Any,
        batch_indices: list[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        if not trainer.predict_loop.return_predictions:
            return
        indices = list(batch_indices or []) or _loader_positions(trainer, dataloader_idx, batch_idx)
        self.records.append((dataloader_idx, indices, namespaces.to_cpu(prediction)))


def _loader_positions(trainer: pl.Trainer, dataloader_idx: int, batch_idx: int) -> list[int]:
    """A batch's dataset positions from a loader that records them (``RayDataModule``'s: no sampler to ask)."""
    loaders = trainer.predict_dataloaders
    loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
    positions = getattr(loaders[dataloader_idx], "positions", None) if dataloader_idx < len(loaders) else None
    if not positions or batch_idx >= len(positions):
        return []
    return list(positions[batch_idx])


def merge_predictions(per_rank: list[list[tuple[int, list[int], Any]]], num_dataloaders: int) -> Any:
    """Put every rank's predicted batches back into dataset order.

    Returns what a single-process ``trainer.predict`` returns: a list of batch outputs (a list of
    such lists for several dataloaders), re-batched with the dataloader's batch size. Outputs that
    cannot be split per sample (not tensors with a batch dimension) are returned per batch, ordered
    by their first dataset index.
    """
    merged = []
    for dl_idx in range(max(num_dataloaders, 1)):
        batches = [(idx, pred) for rank in per_rank for (d, idx, pred) in rank if d == dl_idx]
        merged.append(_merge_one_dataloader(batches))
    return merged[0] if num_dataloaders <= 1 else merged


def _merge_one_dataloader(batches: list[tuple[list[int], Any]]) -> list[Any]:
    if not batches:
        return []
    if not all(indices and _batch_len(pred) == len(indices) for indices, pred in batches):
        warnings.warn(
            "ray_lightning: predictions are not tensors with a batch dimension (or batch indices are unknown); "
            "returning them per batch, ordered by the first dataset index of each batch.",
            stacklevel=2,
        )
        return [pred for _, pred in sorted(batches, key=lambda b: b[0][0] if b[0] else 0)]
    batch_size = max(len(indices) for indices, _ in batches)
    samples: dict[int, Any] = {}
    for indices, pred in batches:
        for pos, index in enumerate(indices):
            samples.setdefault(index, _take(pred, pos))
    ordered = [samples[i] for i in sorted(samples)]
    return [_concat(ordered[start : start + batch_size]) for start in range(0, len(ordered), batch_size)]


def _batch_len(pred: Any) -> int | None:
    if isinstance(pred, torch.Tensor):
        return pred.shape[0] if pred.dim() > 0 else None
    if isinstance(pred, dict) and pred:
        lengths = {_batch_len(v) for v in pred.values()}
    elif isinstance(pred, (list, tuple)) and pred:
        lengths = {_batch_len(v) for v in pred}
    else:
        return None
    return lengths.pop() if len(lengths) == 1 else None


def _take(pred: Any, pos: int) -> Any:
    if isinstance(pred, torch.Tensor):
        return pred[pos : pos + 1]
    if isinstance(pred, dict):
        return {k: _take(v, pos) for k, v in pred.items()}
    return (
        type(pred)(_take(v, pos) for v in pred)
        if not _is_namedtuple(pred)
        else type(pred)(*(_take(v, pos) for v in pred))
    )


def _concat(samples: list[Any]) -> Any:
    first = samples[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(samples)
    if isinstance(first, dict):
        return {k: _concat([s[k] for s in samples]) for k in first}
    parts = [_concat([s[i] for s in samples]) for i in range(len(first))]
    return type(first)(*parts) if _is_namedtuple(first) else type(first)(parts)


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")
