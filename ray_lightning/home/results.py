"""What comes back from the workers, and how it lands on the driver's Trainer and module.

:class:`WorkerOutput` is the whole contract: :func:`collect_worker_output` fills it in each worker
when the Trainer function returns, :func:`apply_to_driver` reads rank 0's on the driver. Rank 0
sends trained weights (:mod:`.weights`), metrics, loop progress (so ``trainer.current_epoch``/
``global_step`` are right, and the next ``fit`` logs at the steps after), the state of stateful
callbacks (``ModelCheckpoint.best_model_path``/``best_model_score``, ``EarlyStopping``...), what
its loggers learned (:mod:`.loggers`), and, when it ran off the driver's machine, the files it
wrote (:mod:`.files`). When predicting, every rank sends its predictions with their dataset
indices (:mod:`.predictions`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ray_lightning import _lightning, namespaces
from ray_lightning.home import files, landing, loggers
from ray_lightning.home.optimizers import apply_on_driver, settings_for_driver
from ray_lightning.home.outbox import Outbox, SentFile
from ray_lightning.home.predictions import PredictionRecorder
from ray_lightning.home.weights import WeightPart, load_chunks, pack_in_chunks, parts_of

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)


@dataclass
class WorkerOutput:
    """Sent by a worker when its ``fit``/``validate``/``test``/``predict`` returns."""

    global_rank: int
    trainer_state: Any = None  # Lightning's TrainerState
    results: Any = None
    # The trained weights this rank holds for the driver, packed in chunks (home.weights); the worker keeps
    # them and sends their number instead, and the driver asks for them one at a time.
    weights: list[Any] | int | None = None
    callback_metrics: dict[str, Any] = field(default_factory=dict)
    logged_metrics: dict[str, Any] = field(default_factory=dict)
    progress_bar_metrics: dict[str, Any] = field(default_factory=dict)
    fit_progress: dict[str, Any] | None = None
    # (state_key, state) in the workers' callback order; two callbacks may share a state_key.
    callback_states: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    # What each logger learned that the driver's copy needs (checkpoints logged as artifacts), in order.
    logger_states: list[dict[str, Any]] = field(default_factory=list)
    # Keyed by driver paths: small files' bytes, large ones' copies in the driver's folder (home.outbox.Outbox).
    files: dict[str, bytes | SentFile] = field(default_factory=dict)
    staged: bool = False  # rank 0 wrote its files elsewhere and sent them: `files` is all there is
    predictions: list[tuple[int, list[int], Any]] | None = None
    num_predict_dataloaders: int = 0
    return_predictions: bool = False
    # Rank 0 after a fit: its optimizers' and schedulers' settings, no tensors (home.optimizers).
    optimizer_settings: dict[str, Any] | None = None


def collect_worker_output(
    trainer: pl.Trainer,
    results: Any,
    recorder: PredictionRecorder | None,
    staging: str | None,
    home: str | None = None,
) -> WorkerOutput | None:
    """Runs in every worker after the Trainer function returned; None from ranks with nothing to send.

    ``staging``: where rank 0 wrote its files instead of the driver's paths, if it did; ``home``: the driver's folder
    its large files are copied into (:class:`~.outbox.Outbox`).
    """
    rank = trainer.global_rank
    fitting = trainer.state.fn == namespaces.FITTING
    # Every rank computes the state dict: torchmetrics states may sync across ranks, and each rank of
    # a sharded strategy sends its own shards (``weights_for_driver``).
    parts = _weights_for_driver(trainer) if fitting else None
    weights = pack_in_chunks(parts) if parts else None
    predicting = trainer.state.fn == namespaces.PREDICTING
    predictions = recorder.records if recorder is not None else None
    if rank != 0:
        # A rank of a sharded strategy off the driver's machine sends its parts of the checkpoints.
        shards = files.collect(staging, Outbox(home)) if staging is not None else {}
        if not predictions and not shards and not weights:
            return None
        return WorkerOutput(
            global_rank=rank, predictions=predictions, files=shards, staged=bool(shards), weights=weights
        )

    output = WorkerOutput(
        global_rank=rank,
        trainer_state=trainer.state,
        # When predicting, the driver rebuilds the results from every rank's `predictions`.
        results=None if predicting else namespaces.to_cpu(results),
        weights=weights,
        callback_metrics=namespaces.to_cpu(dict(trainer.callback_metrics)),
        logged_metrics=namespaces.to_cpu(dict(trainer.logged_metrics)),
        progress_bar_metrics=namespaces.to_cpu(dict(trainer.progress_bar_metrics)),
        fit_progress=_lightning.fit_progress_state(trainer) if fitting else None,
        logger_states=loggers.states_for_driver(trainer, staging),
        predictions=predictions,
        num_predict_dataloaders=len(trainer.num_predict_batches) if predicting else 0,
        return_predictions=predicting and trainer.predict_loop.return_predictions,
        optimizer_settings=settings_for_driver(trainer) if fitting else None,
    )
    for callback in trainer.callbacks:
        state = callback.state_dict()
        if state:
            if staging is not None:
                state = files.from_staged(state, staging)
            output.callback_states.append((callback.state_key, namespaces.to_cpu(state)))
    if staging is not None:
        output.staged = True
        output.files = _staged_files(trainer, staging, home)
    return output


def _weights_for_driver(trainer: pl.Trainer) -> list[WeightPart] | None:
    """What this rank sends of the trained weights: rank 0's full state dict, or a sharded strategy's parts.

    A strategy's ``weights_for_driver`` (every rank calls it) returns parts, a full state dict, or None
    (nothing from this rank, or the weights stay in the workers).
    """
    gather = getattr(trainer.strategy, "weights_for_driver", None)
    weights = gather() if gather is not None else trainer.lightning_module.state_dict()
    if weights is None or (gather is None and trainer.global_rank != 0):
        return None
    return parts_of(weights) if isinstance(weights, dict) else list(weights)


def _staged_files(trainer: pl.Trainer, staging: str, home: str | None) -> dict[str, bytes | SentFile]:
    """What rank 0 wrote under ``staging``, and the checkpoints it wrote elsewhere, keyed by driver paths."""
    outbox = Outbox(home)  # one budget for all of rank 0's files
    found = files.collect(staging, outbox)
    # Checkpoint callbacks added in the workers (configure_callbacks) wrote to their own paths.
    for path in _checkpoint_files(trainer):
        if not path.startswith(staging + os.sep):
            found[path] = outbox.take(path)
    return found


def _checkpoint_files(trainer: pl.Trainer) -> set[str]:
    paths: set[str] = set()
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, namespaces.every("callbacks.ModelCheckpoint")):
            paths.update(str(p) for p in callback.best_k_models)
            paths.update(
                str(p) for p in (callback.best_model_path, callback.last_model_path, callback.kth_best_model_path)
            )
    return {p for p in paths if p and os.path.isfile(p)}


def apply_to_driver(
    trainer: pl.Trainer, output: WorkerOutput, scope: landing.WriteScope, weight_chunks: Iterable[Any] = ()
) -> list[str]:
    """Make the driver's Trainer and module look as if rank 0's run had happened here.

    ``scope``: where the files rank 0 sent back may be written (:class:`~.landing.WriteScope`, made
    before the launch). ``weight_chunks``: the chunks of trained weights the workers hold, as the
    launcher fetches them (:mod:`.weights`). Returns the paths of the files written.
    """
    arrived = []

    def counted() -> Iterator[Any]:
        for chunk in weight_chunks:
            arrived.append(True)
            yield chunk

    load_chunks(trainer.lightning_module, counted())
    if output.fit_progress is not None and getattr(trainer.strategy, "_send_full_weights", True) is None:
        # full_weights_home=None was decided in the workers, from the model's real size: this process learns it.
        trainer.strategy._send_full_weights = bool(arrived)
    if output.optimizer_settings is not None:
        apply_on_driver(trainer, output.optimizer_settings)
    if output.trainer_state is not None:
        trainer.state = output.trainer_state
    for name in ("callback_metrics", "logged_metrics", "progress_bar_metrics"):
        target = getattr(trainer, name)
        target.clear()
        target.update(getattr(output, name))
    if output.fit_progress is not None:
        _lightning.load_fit_progress(trainer, output.fit_progress)
    scope = scope.with_checkpoints(output.callback_states)
    _load_callback_states(trainer, output, scope)
    loggers.load_states(trainer, output.logger_states)
    return landing.write(loggers.arriving_files(trainer, output.files), scope)


def _load_callback_states(trainer: pl.Trainer, output: WorkerOutput, scope: landing.WriteScope) -> None:
    remaining = list(output.callback_states)
    for callback in trainer.callbacks:
        match = next((i for i, (key, _) in enumerate(remaining) if key == callback.state_key), None)
        if match is None:
            continue
        state = remaining.pop(match)[1]
        if isinstance(callback, namespaces.every("callbacks.ModelCheckpoint")):
            _load_checkpoint_callback(callback, state, output, scope)
        else:
            callback.load_state_dict(state)


def _load_checkpoint_callback(
    callback: Any, state: dict[str, Any], output: WorkerOutput, scope: landing.WriteScope
) -> None:
    dirpath = state.get("dirpath", callback.dirpath)
    if output.staged and dirpath and not scope.allows(str(dirpath)):
        # The next call's scope starts from this dirpath: it must stay where the Trainer writes.
        log.warning(
            "ray_lightning: ignored the state of %s sent back by rank 0: its directory %s is outside those this "
            "Trainer writes to.",
            type(callback).__name__,
            dirpath,
        )
        return
    # load_state_dict only restores everything when dirpath matches; the driver never resolved one.
    callback.dirpath = dirpath
    callback.current_score = state.get("current_score")
    superseded = {*callback.best_k_models, callback.last_model_path}
    callback.load_state_dict(state)
    if output.staged:
        # Rank 0 removed the files it replaced (save_top_k) in its staging directory, where the
        # earlier calls' files never were: remove them here, as Lightning would have.
        kept = {*callback.best_k_models, callback.best_model_path, callback.last_model_path}
        for path in superseded - kept - set(output.files):
            if path and os.path.isfile(path) and scope.allows(path):
                os.remove(path)
