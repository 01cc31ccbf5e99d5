"""What comes back from the workers, and how it lands on the driver's Trainer and module.

Rank 0 sends one :class:`WorkerOutput`: trained weights, metrics, loop progress (so
``trainer.current_epoch``/``global_step`` are right), the state of stateful callbacks
(``ModelCheckpoint.best_model_path``/``best_model_score``, ``EarlyStopping``...), and, when it ran
off the driver's machine, the files it wrote (:mod:`ray_lightning.driver_files`). When predicting,
every rank sends its predictions with their dataset indices, and the driver puts them back into
dataset order.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.apply_func import move_data_to_device
from pytorch_lightning.callbacks import BasePredictionWriter, ModelCheckpoint
from pytorch_lightning.trainer.states import TrainerFn, TrainerState

from ray_lightning import driver_files


@dataclass
class WorkerOutput:
    """Sent by a worker when its ``fit``/``validate``/``test``/``predict`` returns."""

    global_rank: int
    trainer_state: TrainerState | None = None
    results: Any = None
    weights: dict[str, Any] | None = None  # see pack_weights
    callback_metrics: dict[str, Any] = field(default_factory=dict)
    logged_metrics: dict[str, Any] = field(default_factory=dict)
    progress_bar_metrics: dict[str, Any] = field(default_factory=dict)
    fit_progress: dict[str, Any] | None = None
    # (state_key, state) in the workers' callback order; two callbacks may share a state_key.
    callback_states: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)
    staged: bool = False  # rank 0 wrote its files elsewhere and sent them: `files` is all there is
    predictions: list[tuple[int, list[int], Any]] | None = None
    num_predict_dataloaders: int = 0
    return_predictions: bool = False


class PredictionRecorder(BasePredictionWriter):
    """Added to each worker's Trainer while predicting: keeps every batch's prediction with its dataset indices.

    Nothing is kept with ``trainer.predict(..., return_predictions=False)``.
    """

    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.records: list[tuple[int, list[int], Any]] = []

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
        self.records.append((dataloader_idx, list(batch_indices or []), move_data_to_device(prediction, "cpu")))


def collect_worker_output(
    trainer: pl.Trainer,
    results: Any,
    recorder: PredictionRecorder | None,
    staging: str | None,
) -> WorkerOutput | None:
    """Runs in every worker after the Trainer function returned.

    ``staging``: where rank 0 wrote its files instead of the driver's paths, if it did.
    """
    rank = trainer.global_rank
    fitting = trainer.state.fn == TrainerFn.FITTING
    # Every rank computes the state dict: torchmetrics states may sync across ranks.
    weights = trainer.lightning_module.state_dict() if fitting else None
    predicting = trainer.state.fn == TrainerFn.PREDICTING
    predictions = recorder.records if recorder is not None else None
    if rank != 0:
        return WorkerOutput(global_rank=rank, predictions=predictions) if predictions else None

    output = WorkerOutput(
        global_rank=rank,
        trainer_state=trainer.state,
        # When predicting, the driver rebuilds the results from every rank's `predictions`.
        results=None if predicting else move_data_to_device(results, "cpu"),
        weights=pack_weights(weights) if weights is not None else None,
        callback_metrics=move_data_to_device(dict(trainer.callback_metrics), "cpu"),
        logged_metrics=move_data_to_device(dict(trainer.logged_metrics), "cpu"),
        progress_bar_metrics=move_data_to_device(dict(trainer.progress_bar_metrics), "cpu"),
        predictions=predictions,
        num_predict_dataloaders=len(trainer.num_predict_batches) if predicting else 0,
        return_predictions=predicting and trainer.predict_loop.return_predictions,
    )
    if fitting:
        loop = trainer.fit_loop
        output.fit_progress = {
            "epoch_progress": loop.epoch_progress.state_dict(),
            "epoch_loop.batch_progress": loop.epoch_loop.batch_progress.state_dict(),
            "automatic_optimization": loop.epoch_loop.automatic_optimization.optim_progress.state_dict(),
            "manual_optimization": loop.epoch_loop.manual_optimization.optim_step_progress.state_dict(),
        }
    for callback in trainer.callbacks:
        state = callback.state_dict()
        if state:
            if staging is not None:
                state = driver_files.from_staged(state, staging)
            output.callback_states.append((callback.state_key, move_data_to_device(state, "cpu")))
    if staging is not None:
        output.staged = True
        output.files = driver_files.collect(staging)
        # Checkpoint callbacks added in the workers (configure_callbacks) wrote to their own paths.
        for path in _checkpoint_files(trainer):
            if not path.startswith(staging + os.sep):
                with open(path, "rb") as f:
                    output.files[path] = f.read()
    return output


def _checkpoint_files(trainer: pl.Trainer) -> set[str]:
    paths: set[str] = set()
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            paths.update(str(p) for p in callback.best_k_models)
            paths.update(
                str(p) for p in (callback.best_model_path, callback.last_model_path, callback.kth_best_model_path)
            )
    return {p for p in paths if p and os.path.isfile(p)}


def pack_weights(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state dict made of numpy byte arrays, which Ray moves without extra copies.

    Ray pickles a torch tensor into the message as bytes, then copies that into the object store,
    and the driver copies it out again. A numpy array instead goes into the object store with one
    copy and is read there in place by the driver, so the only other copy is ``load_state_dict``'s.
    Bytes (``uint8``) keep every dtype, including those numpy lacks (bfloat16, float8).
    """
    packed: dict[str, Any] = {}
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_quantized:
            tensor = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
            data = tensor.reshape(-1).view(torch.uint8).numpy()
            packed[name] = _PackedTensor(tensor.dtype, tuple(tensor.shape), data)
        else:
            packed[name] = move_data_to_device(value, "cpu")
    return packed


def unpack_weights(packed: dict[str, Any]) -> dict[str, Any]:
    """Tensors viewing :func:`pack_weights`' arrays (no copy)."""
    return {name: value.tensor() if isinstance(value, _PackedTensor) else value for name, value in packed.items()}


@dataclass(frozen=True)
class _PackedTensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    data: Any  # a 1-D numpy uint8 array

    def tensor(self) -> torch.Tensor:
        if self.data.size == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.from_numpy(self.data).view(self.dtype).reshape(self.shape)


def apply_to_driver(trainer: pl.Trainer, output: WorkerOutput) -> None:
    """Make the driver's Trainer and module look as if rank 0's run had happened here."""
    if output.weights is not None:
        module = trainer.lightning_module
        with warnings.catch_warnings():
            # The tensors read the object store's read-only memory in place; load_state_dict only copies from them.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            weights = unpack_weights(output.weights)
        # Parameters and buffers are copied into; other state (torchmetrics' states, extra state) may
        # be kept as given, so it gets memory of its own instead of the object store's.
        copied = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
        weights = {k: v if k in copied or not isinstance(v, torch.Tensor) else v.clone() for k, v in weights.items()}
        # Non-strict like Lightning's ddp_spawn: layers may have been added in the workers' setup hooks.
        module.load_state_dict(weights, strict=False)
        output.weights = weights = None  # release the object store's memory
    if output.trainer_state is not None:
        trainer.state = output.trainer_state
    for name in ("callback_metrics", "logged_metrics", "progress_bar_metrics"):
        target = getattr(trainer, name)
        target.clear()
        target.update(getattr(output, name))
    if output.fit_progress is not None:
        loop = trainer.fit_loop
        progress = output.fit_progress
        loop.epoch_progress.load_state_dict(progress["epoch_progress"])
        loop.epoch_loop.batch_progress.load_state_dict(progress["epoch_loop.batch_progress"])
        loop.epoch_loop.automatic_optimization.optim_progress.load_state_dict(progress["automatic_optimization"])
        loop.epoch_loop.manual_optimization.optim_step_progress.load_state_dict(progress["manual_optimization"])
    remaining = list(output.callback_states)
    for callback in trainer.callbacks:
        match = next((i for i, (key, _) in enumerate(remaining) if key == callback.state_key), None)
        if match is None:
            continue
        state = remaining.pop(match)[1]
        superseded: set[str] = set()
        if isinstance(callback, ModelCheckpoint):
            # load_state_dict only restores everything when dirpath matches; the driver never resolved one.
            callback.dirpath = state.get("dirpath", callback.dirpath)
            callback.current_score = state.get("current_score")
            superseded = {*callback.best_k_models, callback.last_model_path}
        callback.load_state_dict(state)
        if isinstance(callback, ModelCheckpoint) and output.staged:
            # Rank 0 removed the files it replaced (save_top_k) in its staging directory, where the
            # earlier calls' files never were: remove them here, as Lightning would have.
            kept = {*callback.best_k_models, callback.best_model_path, callback.last_model_path}
            for path in superseded - kept - set(output.files):
                if path and os.path.isfile(path):
                    os.remove(path)
    driver_files.write(output.files)


# -- predictions -----------------------------------------------------------------------------------


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
