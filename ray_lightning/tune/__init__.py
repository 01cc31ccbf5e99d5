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
on rank 0, where the metrics are, and send them with :func:`ray_lightning.channel.driver_channel.ask_driver`
to the trial's process, the only place ``ray.tune.report`` works; its answer (did Tune stop the
trial?) reaches every rank, which then end ``fit`` together. Checkpoints travel as bytes through
Ray's object store, so they reach Tune's storage from any node, shared filesystem or not. A trial
Tune restores resumes inside ``fit`` (:class:`TuneReportCheckpointCallback`), and its workers stay
for the next trial Tune runs in the same process (``reuse_actors=True``).
"""

from __future__ import annotations

from collections.abc import Mapping

from ray.tune import PlacementGroupFactory

from ray_lightning.config.resources import resolve_worker_resources
from ray_lightning.home.optimizers import optimizer_settings
from ray_lightning.launch.placement import trial_bundles
from ray_lightning.tune.callbacks import TuneReportCallback, TuneReportCheckpointCallback
from ray_lightning.tune.fabric import report
from ray_lightning.tune.settings import SETTINGS_KEY, keep_configured_settings
from ray_lightning.tune.trial import MARKER_FILE, report_to_tune

__all__ = [
    "MARKER_FILE",
    "SETTINGS_KEY",
    "TuneReportCallback",
    "TuneReportCheckpointCallback",
    "get_tune_resources",
    "keep_configured_settings",
    "optimizer_settings",
    "report",
    "report_to_tune",
]


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
