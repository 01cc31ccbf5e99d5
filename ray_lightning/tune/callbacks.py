"""The callbacks a trial's Trainer reports to Tune with: metrics (:class:`TuneReportCallback`) and checkpoints
(:class:`TuneReportCheckpointCallback`). They run in the ranks; rank 0 sends each report to the trial's process
(:mod:`.trial`), and a checkpoint is written by the ranks into Tune's own folder."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from ray_lightning import namespaces, runtime
from ray_lightning.channel.driver_channel import ask_driver
from ray_lightning.home import storage
from ray_lightning.home.optimizers import optimizer_settings
from ray_lightning.home.recovery import write_checkpoint
from ray_lightning.tune import trial
from ray_lightning.tune.settings import SETTINGS_KEY, keep_configured_settings

if TYPE_CHECKING:
    import pytorch_lightning as pl


def _callback_hooks() -> list[str]:
    callback = namespaces.primary().pl("Callback")
    return sorted(name for name in dir(callback) if name.startswith("on_") and callable(getattr(callback, name)))


def _hook_names(on: str | Sequence[str]) -> list[str]:
    if not isinstance(on, Iterable):
        raise TypeError(f"`on` takes a Lightning hook name such as 'validation_end', or a list of them, got {on!r}.")
    names = [on] if isinstance(on, str) else list(on)
    if not names:
        raise ValueError("`on` names at least one Lightning callback hook, e.g. 'validation_end'.")
    valid = _callback_hooks()
    hooks = []
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"`on` takes Lightning hook names, got {name!r}.")
        hook = name if name.startswith("on_") else f"on_{name}"
        if hook not in valid:
            shown = ", ".join(h[3:] for h in valid)
            raise ValueError(f"{name!r} is not a Lightning callback hook. Use one of: {shown}.")
        hooks.append(hook)
    return hooks


def _metric_names(metrics: None | str | Sequence[str] | Mapping[str, str]) -> dict[str, str] | None:
    """``{name reported to Tune: name logged in Lightning}``, or None for every logged metric."""
    if metrics is None:
        return None
    if isinstance(metrics, str):
        return {metrics: metrics}
    if isinstance(metrics, Mapping):
        pairs = dict(metrics)
    elif isinstance(metrics, Iterable):
        pairs = {m: m for m in metrics}
    else:
        raise TypeError(
            "metrics takes None (every logged metric), a metric name, a list of names or a dict "
            f"{{'name for Tune': 'name logged in Lightning'}}, got {metrics!r}."
        )
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in pairs.items()):
        raise TypeError(f"metrics names must be strings, got {metrics!r}.")
    return pairs


class TuneReportCallback(*namespaces.every("callbacks.Callback")):
    """Report Lightning's logged metrics to Ray Tune from a trial's training.

    Works with ``RayStrategy``/``HorovodRayStrategy`` (rank 0 reports through the trial's process)
    and with single-process Trainers inside a trial. Each report is one Tune ``training_iteration``.
    Sanity-check validation is never reported.

    Args:
        metrics: ``None`` (every metric in ``trainer.callback_metrics``), a name, a list of names,
            or a dict ``{"name for Tune": "name logged in Lightning"}``. A requested metric that was
            not logged fails the trial with an error naming the metrics that were.
        on: the Lightning hook(s) to report at, with or without ``on_``: ``"validation_end"``
            (default), ``"train_epoch_end"``, ``["train_batch_end", "validation_end"]``, ...
        every: report every N-th time: at batch hooks (``"train_batch_end"``) when the optimizer step count
            (``trainer.global_step``) is a multiple of N, at the other hooks in every N-th epoch.

    Example::

        TuneReportCallback({"loss": "val_loss", "acc": "val_acc"}, on="validation_end")
        TuneReportCallback("train_loss", on="train_batch_end", every=50)   # every 50 optimizer steps

    It is a ``Callback`` of ``lightning.pytorch`` and of ``pytorch_lightning`` (whichever are
    installed), so one object serves either Trainer.
    """

    # Tells the launcher to open a channel from the workers to the trial's process.
    needs_driver_channel = True

    def __init__(
        self,
        metrics: None | str | Sequence[str] | Mapping[str, str] = None,
        on: str | Sequence[str] = "validation_end",
        every: int = 1,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a whole number >= 1 (report every N-th step or epoch), got {every!r}.")
        self._metrics = _metric_names(metrics)
        self._on = _hook_names(on)
        self._every = every
        self._last_step: dict[str, int] = {}
        for hook in self._on:
            # The class's own method for that hook (the checkpoint callback's bookkeeping) runs first.
            setattr(self, hook, functools.partial(self._at_hook, hook, getattr(self, hook)))

    @property
    @override
    def state_key(self) -> str:
        # Lightning counts a callback of two namespaces as stateful (its state_dict differs from one
        # namespace's Callback), and refuses two stateful callbacks with one key: the key names the settings.
        every = f", 'every': {self._every}" if self._every != 1 else ""
        return f"{type(self).__qualname__}{{'metrics': {self._metrics!r}, 'on': {self._on!r}{every}}}"

    def _at_hook(
        self, hook: str, own: Any, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ):
        own(trainer, pl_module, *args, **kwargs)
        if trainer.sanity_checking or not self._due(hook, trainer):
            return
        self._report(trainer)

    def _due(self, hook: str, trainer: pl.Trainer) -> bool:
        """Whether this firing of ``hook`` is one of every N-th step (batch hooks) or epoch (the others)."""
        if self._every == 1:
            return True
        if "batch" not in hook:
            return (trainer.current_epoch + 1) % self._every == 0
        step = trainer.global_step
        # With gradient accumulation a batch ends without a step: the step's report is made once.
        if step == 0 or step % self._every or self._last_step.get(hook) == step:
            return False
        self._last_step[hook] = step
        return True

    def _collect(self, trainer: pl.Trainer) -> dict[str, Any]:
        logged = {name: plain(value) for name, value in trainer.callback_metrics.items()}
        if self._metrics is None:
            return logged
        missing = sorted(source for source in self._metrics.values() if source not in logged)
        if missing:
            raise ValueError(
                f"{type(self).__name__} was asked for metric(s) {', '.join(map(repr, missing))}, which were not "
                f"logged by this point; logged metrics: {', '.join(map(repr, sorted(logged))) or 'none'}."
            )
        return {target: logged[source] for target, source in self._metrics.items()}

    def _report(self, trainer: pl.Trainer) -> None:
        self._send(trainer, self._collect(trainer) if trainer.is_global_zero else {}, None)

    def _send(self, trainer: pl.Trainer, metrics: dict[str, Any], checkpoint: tuple[str, bytes | None] | None) -> None:
        """Rank 0 reports and waits for Tune to take it; every rank learns whether Tune stopped the trial."""
        if runtime.current_context() is None:
            # A Trainer in the trial's own process: Tune's stop ends the function right here, as Tune does.
            if trainer.is_global_zero:
                trial.report_to_tune(metrics, checkpoint)
            return
        stopped = ask_driver(trial.report_to_tune, metrics, checkpoint, True) if trainer.is_global_zero else False
        if trainer.world_size > 1:
            stopped = trainer.strategy.broadcast(stopped, src=0)
        if stopped:
            # Every rank ends fit at the same step; the workers stay for the trial Tune runs next in this process.
            trainer.should_stop = True

    @contextlib.contextmanager
    def around_driver_call(self, trainer: pl.Trainer) -> Iterator[str | None]:
        """On the driver, around each call (``ray_lightning.launch.payload.enter_driver_hooks``): when Tune stopped
        the trial during it, the trial's function ends after the call, as ``ray.tune.report`` would have ended it."""
        trial.give_stopped_trials_time_to_end()
        yield None
        trial.end_if_tune_stopped()


class TuneReportCheckpointCallback(TuneReportCallback):
    """Report metrics to Ray Tune together with a Lightning checkpoint of the training so far.

    The checkpoint (weights, optimizer, loops, callbacks: what ``trainer.save_checkpoint`` writes) is
    written by the ranks themselves straight into the folder Tune keeps the trial's checkpoint in (Tune's
    ``storage_path``, a directory or a bucket): rank 0 writes one file, and under
    ``RayFSDPStrategy``/``RayModelParallelStrategy`` every rank writes its own shards (torch's distributed
    checkpoint, a directory named ``filename``), never gathered. Tune is handed a note of a few bytes; nothing of
    the checkpoint passes through the trial's process, whatever the model's size. Load a full one with
    ``Model.load_from_checkpoint(os.path.join(result.checkpoint.path, filename))``. Where fsspec cannot reach
    Tune's storage (a custom pyarrow filesystem) the checkpoint goes through the trial's process as bytes, as
    before, and a warning says why.

    **A trial Tune restores resumes by itself.** When Tune starts a trial from a checkpoint this
    callback reported (PBT/PB2 exploiting another trial, Tune's ``max_failures`` retrying one), the
    trial's first ``trainer.fit(model)`` given no ``ckpt_path`` resumes from it: weights, optimizer
    state (momentum buffers), epoch and step. The hyperparameters of the new trial stay in force: an
    optimizer setting that this trial's ``configure_optimizers`` sets to another value than the trial
    that wrote the checkpoint did (learning rate, momentum, weight decay of each param group: what PBT
    mutated) keeps this trial's value, and a learning-rate schedule goes on from it; the module's
    ``hparams`` are the ones it was built with. Settings both trials configured alike (a learning rate
    a scheduler has decayed since) come from the checkpoint.

    Args:
        metrics: as for :class:`TuneReportCallback`.
        filename: the checkpoint file's name inside Tune's checkpoint directory.
        on: as for :class:`TuneReportCallback`.
        every: as for :class:`TuneReportCallback`; each report carries a checkpoint, so a trial with results
            always has one for PBT to clone.
        resume: ``False`` to start every ``fit`` afresh (resume yourself with ``ckpt_path``).

    Example::

        def train_fn(config):
            trainer = pl.Trainer(max_epochs=10, strategy=RayStrategy(num_workers=2),
                                 callbacks=[TuneReportCheckpointCallback({"loss": "val_loss"})])
            trainer.fit(MyModule(lr=config["lr"]))   # resumes where Tune restored the trial

        tune.Tuner(tune.with_resources(train_fn, get_tune_resources(num_workers=2)),
                   tune_config=tune.TuneConfig(scheduler=PopulationBasedTraining(
                       time_attr="training_iteration", perturbation_interval=2,
                       hyperparam_mutations={"lr": tune.loguniform(1e-4, 1e-1)}),
                       metric="loss", mode="min", num_samples=4)).fit()
    """

    def __init__(
        self,
        metrics: None | str | Sequence[str] | Mapping[str, str] = None,
        filename: str = "checkpoint",
        on: str | Sequence[str] = "validation_end",
        every: int = 1,
        resume: bool = True,
    ) -> None:
        if not isinstance(filename, str) or not filename or os.path.isabs(filename) or ".." in filename.split("/"):
            raise ValueError(f"filename must be a relative file name such as 'checkpoint', got {filename!r}.")
        if filename == trial.MARKER_FILE:
            raise ValueError(
                f"filename {trial.MARKER_FILE!r} is the name ray_lightning gives its own note; choose another."
            )
        super().__init__(metrics, on, every)
        self._filename = filename
        self._resume = bool(resume)
        # This fit's optimizer settings as configure_optimizers made them; the checkpoint's, when resuming.
        self._configured: list[list[dict[str, Any]]] | None = None
        self._restored: list[list[dict[str, Any]]] | None = None
        # Set on the driver before each call (and sent to the workers with the Trainer): Tune's storage of this
        # trial, which the ranks write to themselves; None: the checkpoint goes through the trial's process.
        self._in_storage = False
        # The checkpoint Tune restored this trial with, when every worker reads it in place (the launcher).
        self.checkpoint_read_in_place: str | None = None

    @contextlib.contextmanager
    @override
    def around_driver_call(self, trainer: pl.Trainer) -> Iterator[str | None]:
        """Also yields the file of the checkpoint Tune restored this trial with, in the trial's first fit."""
        trial.give_stopped_trials_time_to_end()
        strategy = type(trainer.strategy).__name__
        self._in_storage = trial.ranks_write_to_tune_storage(strategy if _rank_directory(trainer) else None)
        self.checkpoint_read_in_place = None
        fitting = trainer.state.fn == "fit"
        checkpoint = trial.restored_checkpoint() if fitting and self._resume and trial.first_fit_of_trial() else None
        if checkpoint is None:
            yield None
            trial.end_if_tune_stopped()
            return
        location = trial.checkpoint_in_storage(checkpoint)
        if location is not None:
            say = namespaces.of(trainer).pl("utilities.rank_zero.rank_zero_info")
            say(f"ray_lightning.tune: this trial resumes from the checkpoint Tune restored it with, {location}")
            self.checkpoint_read_in_place = location
            yield location
            trial.end_if_tune_stopped()
            return
        with checkpoint.as_directory() as directory:
            path = trial.checkpoint_file(directory)
            if path is not None:
                say = namespaces.of(trainer).pl("utilities.rank_zero.rank_zero_info")
                say(f"ray_lightning.tune: this trial resumes from the checkpoint Tune restored it with, {path}")
            yield path
        trial.end_if_tune_stopped()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The optimizers exist (strategy setup ran) and no checkpoint was loaded into them yet.
        self._configured = optimizer_settings(trainer.optimizers)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if self._configured is not None:
            checkpoint[SETTINGS_KEY] = self._configured

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self._restored = checkpoint.get(SETTINGS_KEY)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning restored the optimizers (and their settings) from the checkpoint before this hook.
        restored, self._restored = self._restored, None
        if restored is None or self._configured is None:
            return
        kept = keep_configured_settings(trainer, self._configured, restored)
        if kept and trainer.is_global_zero:
            say = namespaces.of(trainer).pl("utilities.rank_zero.rank_zero_info")
            say(f"ray_lightning.tune: kept this trial's optimizer settings over the checkpoint's: {'; '.join(kept)}")

    def _report(self, trainer: pl.Trainer) -> None:
        metrics = self._collect(trainer) if trainer.is_global_zero else {}
        if self._in_storage and self._report_written_in_place(trainer, metrics):
            return
        self._report_through_trial(trainer, metrics)

    def _report_through_trial(self, trainer: pl.Trainer, metrics: dict[str, Any]) -> None:
        """The checkpoint as bytes through the trial's process (where the ranks cannot write to Tune's storage)."""
        gather = getattr(trainer.strategy, "full_checkpoint", None)
        if gather is not None:
            # A sharded strategy's own checkpoint may be a directory of every rank's shards (on several
            # machines): Tune gets the full checkpoint, gathered on rank 0 by every rank, as one file.
            checkpoint = gather(trainer)
            if trainer.is_global_zero:
                buffer = io.BytesIO()
                torch.save(checkpoint, buffer)
                self._send(trainer, metrics, (self._filename, buffer.getvalue()))
            else:
                self._send(trainer, metrics, None)
            return
        # Every rank takes part in save_checkpoint (it synchronizes them); only rank 0 writes.
        with tempfile.TemporaryDirectory(prefix="ray_lightning-tune-") as directory:
            path = os.path.join(directory, self._filename)
            trainer.save_checkpoint(path)
            storage.uploads().wait()  # with storage_path the file is written in the background
            data = None
            if trainer.is_global_zero:
                with open(path, "rb") as f:
                    data = f.read()
            self._send(trainer, metrics, (self._filename, data) if data is not None else None)

    def _report_written_in_place(self, trainer: pl.Trainer, metrics: dict[str, Any]) -> bool:
        """Every rank writes its part into the folder Tune persists the next checkpoint in; Tune gets a note.

        False (nothing reported) when the trial's process does not see what the ranks wrote: a local storage path
        that is not shared with the ranks' machines. Then this and later reports go through the trial's process.

        Growth law: per report, two small requests from rank 0 to the trial's process and two broadcasts of a few
        bytes; each rank writes its own part of the checkpoint (rank 0 the whole of a full one); the trial's
        process handles a few hundred bytes, whatever the model's size.
        """
        rank_zero = trainer.is_global_zero
        folder = ask_driver(trial.next_checkpoint_folder) if rank_zero else None
        if trainer.world_size > 1:
            folder = trainer.strategy.broadcast(folder, src=0)
        rank_directory = _rank_directory(trainer)
        if rank_directory:
            # DeepSpeed's: every rank writes its part of the directory, with local file I/O, into Tune's folder.
            location = storage.join(folder, self._filename)
            trainer.strategy.save_checkpoint_in_place(trainer, location)
            sees = functools.partial(type(trainer.strategy).sees_checkpoint, location, trainer.world_size)
        else:
            location = write_checkpoint(trainer, storage.join(folder, self._filename), None)
            storage.uploads().wait()  # every rank's part is written (rank 0's also waits for the others' shards)
            sees = functools.partial(trial.sees, location, _sharded(trainer))
        seen = ask_driver(sees) if rank_zero else False
        if trainer.world_size > 1:
            seen = trainer.strategy.broadcast(seen, src=0)
        if not seen and rank_directory:
            raise RuntimeError(f"TuneReportCheckpointCallback: the trial's process does not see the whole checkpoint "
                               f"the ranks wrote to {location}: Tune's storage_path must be a directory every node "
                               "mounts (each rank writes its part of it with local file I/O).")  # fmt: skip
        if not seen:
            self._in_storage = False
            if rank_zero:
                namespaces.of(trainer).pl("utilities.rank_zero.rank_zero_warn")(
                    f"ray_lightning.tune: the trial's process does not see the checkpoint the ranks wrote to "
                    f"{location} (Tune's storage_path is a local directory their machines do not share): this trial's "
                    "checkpoints go through the trial's process as bytes. Use a bucket or a directory every node "
                    "mounts."
                )
            return False
        self._send(trainer, metrics, (self._filename, None))
        return True


def _rank_directory(trainer: pl.Trainer) -> bool:
    """Whether the strategy's checkpoint is a directory every rank writes its part of with local file I/O."""
    return getattr(trainer.strategy, "checkpoint_is_rank_directory", False)


def _sharded(trainer: pl.Trainer) -> bool:
    """Whether the strategy's ranks each write their own shards (torch's distributed checkpoint)."""
    return getattr(trainer.strategy, "checkpoint_to_storage", None) is not None


def plain(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        return value.item()
    return value
