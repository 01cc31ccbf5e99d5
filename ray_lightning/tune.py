"""Ray Tune glue: every trial a multi-worker training, its metrics and checkpoints reported to Tune.

Example::

    from ray import tune
    from ray_lightning import RayStrategy
    from ray_lightning.tune import TuneReportCallback, get_tune_resources

    def train_fn(config):
        trainer = pl.Trainer(max_epochs=4, strategy=RayStrategy(num_workers=2),
                             callbacks=[TuneReportCallback({"loss": "val_loss"}, on="validation_end")])
        trainer.fit(MyModule(lr=config["lr"]))

    analysis = tune.run(train_fn, config={"lr": tune.loguniform(1e-4, 1e-1)}, num_samples=4,
                        metric="loss", mode="min", resources_per_trial=get_tune_resources(num_workers=2))

How it works: the trial's function runs in the trial's own process, which becomes the driver of
the workers; :func:`get_tune_resources` reserves the trial's process and its workers as one
placement group, and the launcher starts the workers in that group's bundles. The callbacks run
on rank 0, where the metrics are, and send them with :func:`ray_lightning.channel.driver_channel.send_to_driver`
to the trial's process, the only place ``ray.tune.report`` works. Checkpoints travel as bytes
through Ray's object store, so they reach Tune's storage from any node, shared filesystem or not.
"""

from __future__ import annotations

import functools
import io
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from ray.tune import PlacementGroupFactory
from typing_extensions import override

from ray_lightning import namespaces
from ray_lightning.channel.driver_channel import send_to_driver
from ray_lightning.config.resources import resolve_worker_resources
from ray_lightning.home import storage
from ray_lightning.launch.placement import trial_bundles

if TYPE_CHECKING:
    import pytorch_lightning as pl


def get_tune_resources(
    num_workers: int = 1,
    num_cpus_per_worker: float = 1,
    use_gpu: bool = False,
    resources_per_worker: Mapping[str, float] | None = None,
) -> PlacementGroupFactory:
    """What a trial that trains on ``num_workers`` Ray workers must reserve.

    Returns a :class:`~ray.tune.PlacementGroupFactory` with one bundle for the trial's own process
    (1 CPU) and one per worker, exactly what ``RayStrategy``/``HorovodRayStrategy`` with the same
    arguments start inside the trial. Pass it as ``tune.run(..., resources_per_trial=...)`` or
    ``tune.with_resources(train_fn, ...)``.

    Example::

        tune.run(train_fn, resources_per_trial=get_tune_resources(num_workers=4, use_gpu=True))
    """
    request = resolve_worker_resources(num_workers, num_cpus_per_worker, use_gpu, resources_per_worker)
    return PlacementGroupFactory(trial_bundles(request), strategy="PACK")


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

    Example::

        TuneReportCallback({"loss": "val_loss", "acc": "val_acc"}, on="validation_end")

    It is a ``Callback`` of ``lightning.pytorch`` and of ``pytorch_lightning`` (whichever are
    installed), so one object serves either Trainer.
    """

    # Tells the launcher to open a channel from the workers to the trial's process.
    needs_driver_channel = True

    def __init__(
        self,
        metrics: None | str | Sequence[str] | Mapping[str, str] = None,
        on: str | Sequence[str] = "validation_end",
    ) -> None:
        self._metrics = _metric_names(metrics)
        self._on = _hook_names(on)
        for hook in self._on:
            setattr(self, hook, functools.partial(self._at_hook, hook))

    @property
    @override
    def state_key(self) -> str:
        # Lightning counts a callback of two namespaces as stateful (its state_dict differs from one
        # namespace's Callback), and refuses two stateful callbacks with one key: the key names the settings.
        return f"{type(self).__qualname__}{{'metrics': {self._metrics!r}, 'on': {self._on!r}}}"

    def _at_hook(self, hook: str, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any):
        if trainer.sanity_checking:
            return
        self._report(trainer)

    def _collect(self, trainer: pl.Trainer) -> dict[str, Any]:
        logged = {name: _plain(value) for name, value in trainer.callback_metrics.items()}
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
        if trainer.is_global_zero:
            send_to_driver(report_to_tune, self._collect(trainer), None)


class TuneReportCheckpointCallback(TuneReportCallback):
    """Report metrics to Ray Tune together with a Lightning checkpoint of the training so far.

    The checkpoint is written by ``trainer.save_checkpoint`` (weights, optimizer, loops, callbacks)
    and stored by Tune with the trial; under ``RayFSDPStrategy``/``RayModelParallelStrategy`` it is
    the full checkpoint gathered on rank 0, one file whatever their ``state_dict_type``. Load it with
    ``Model.load_from_checkpoint(os.path.join(result.checkpoint.path, filename))``; resume a trial
    with ``ray.tune.get_checkpoint()`` and ``trainer.fit(model, ckpt_path=...)``.

    Args:
        metrics: as for :class:`TuneReportCallback`.
        filename: the checkpoint file's name inside Tune's checkpoint directory.
        on: as for :class:`TuneReportCallback`.

    Example::

        def train_fn(config):
            checkpoint = ray.tune.get_checkpoint()
            trainer = pl.Trainer(max_epochs=10, strategy=RayStrategy(num_workers=2),
                                 callbacks=[TuneReportCheckpointCallback({"loss": "val_loss"})])
            if checkpoint:
                with checkpoint.as_directory() as d:
                    trainer.fit(MyModule(), ckpt_path=os.path.join(d, "checkpoint"))
            else:
                trainer.fit(MyModule())
    """

    def __init__(
        self,
        metrics: None | str | Sequence[str] | Mapping[str, str] = None,
        filename: str = "checkpoint",
        on: str | Sequence[str] = "validation_end",
    ) -> None:
        if not isinstance(filename, str) or not filename or os.path.isabs(filename) or ".." in filename.split("/"):
            raise ValueError(f"filename must be a relative file name such as 'checkpoint', got {filename!r}.")
        super().__init__(metrics, on)
        self._filename = filename

    # Strategies whose own checkpoints are written by every rank (DeepSpeed's directories) refuse this
    # callback before launch: it sends Tune one file.
    sends_one_checkpoint_file = True

    def _report(self, trainer: pl.Trainer) -> None:
        metrics = self._collect(trainer) if trainer.is_global_zero else {}
        gather = getattr(trainer.strategy, "full_checkpoint", None)
        if gather is not None:
            # A sharded strategy's own checkpoint may be a directory of every rank's shards (on several
            # machines): Tune gets the full checkpoint, gathered on rank 0 by every rank, as one file.
            checkpoint = gather(trainer)
            if trainer.is_global_zero:
                buffer = io.BytesIO()
                torch.save(checkpoint, buffer)
                send_to_driver(report_to_tune, metrics, (self._filename, buffer.getvalue()))
            return
        # Every rank takes part in save_checkpoint (it synchronizes them); only rank 0 writes.
        with tempfile.TemporaryDirectory(prefix="ray_lightning-tune-") as directory:
            path = os.path.join(directory, self._filename)
            trainer.save_checkpoint(path)
            storage.uploads().wait()  # with storage_path the file is written in the background
            if trainer.is_global_zero:
                with open(path, "rb") as f:
                    data = f.read()
                send_to_driver(report_to_tune, metrics, (self._filename, data))


def report_to_tune(metrics: dict[str, Any], checkpoint: tuple[str, bytes] | None) -> None:
    """Runs in the trial's process: ``ray.tune.report``, with the checkpoint file written to a directory."""
    from ray import tune

    if checkpoint is None:
        tune.report(metrics)
        return
    filename, data = checkpoint
    with tempfile.TemporaryDirectory(prefix="ray_lightning-tune-") as directory:
        path = os.path.join(directory, filename)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        # Tune copies the directory into the trial's storage before report returns.
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(directory))


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        return value.item()
    return value
