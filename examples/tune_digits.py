"""Hyperparameter search with Ray Tune where every trial trains on its own 2 Ray workers (DDP).

    python3 dev.py example --tune                              # via the project's command (sets up .venv)
    python3 dev.py example --tune --num-samples 8 --horovod
    python3 dev.py example --tune --pbt                        # Population Based Training instead of ASHA

The seed README's Tune example, ported to Ray 2.60: the training code lives in a function, Tune
runs it once per sampled config, and ``get_tune_resources`` reserves each trial's process plus its
workers. ``TuneReportCheckpointCallback`` reports the validation metrics and a checkpoint after
every validation; an ASHA scheduler stops the worst trials early, or (``--pbt``) PBT replaces the
worst trials' weights with the best ones' and perturbs their learning rate. A trial Tune restores
(PBT's exploit, a retried failure) resumes inside ``trainer.fit`` from its checkpoint, with its own
learning rate. ``reuse_actors=True`` lets each trial start on the workers of the trial before.
"""

from __future__ import annotations

import argparse
import os
import sys

import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler, PopulationBasedTraining

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from examples.train_digits import DigitsClassifier, DigitsDataModule, pl  # noqa: E402
from ray_lightning import HorovodRayStrategy, RayStrategy  # noqa: E402
from ray_lightning.tune import TuneReportCheckpointCallback, get_tune_resources  # noqa: E402


def train_digits(config: dict, num_workers: int = 2, max_epochs: int = 4, horovod: bool = False) -> None:
    """One trial: a data-parallel training with this trial's hyperparameters."""
    strategy_class = HorovodRayStrategy if horovod else RayStrategy
    trainer = pl.Trainer(
        max_epochs=max_epochs,
        strategy=strategy_class(num_workers=num_workers),
        callbacks=[TuneReportCheckpointCallback({"loss": "val_loss", "acc": "val_acc"}, on="validation_end")],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    model = DigitsClassifier(hidden=config["hidden"], lr=config["lr"])
    # A trial Tune restores (PBT's exploit, a retried failure) resumes here from its checkpoint by itself.
    trainer.fit(model, datamodule=data_for(config))


def data_for(config: dict) -> DigitsDataModule:
    return DigitsDataModule(config["batch_size"])


def scheduler_for(args: argparse.Namespace) -> ASHAScheduler | PopulationBasedTraining:
    if args.pbt:
        # Every 2 epochs the worst quarter of the trials take the best quarter's weights and a perturbed lr.
        return PopulationBasedTraining(
            time_attr="training_iteration",  # epochs (the default, seconds, depends on the machine)
            perturbation_interval=2,
            hyperparam_mutations={"lr": tune.loguniform(1e-3, 1e-1)},
            synch=True,
        )
    return ASHAScheduler(max_t=args.max_epochs, grace_period=1, reduction_factor=2)


def main(argv: list[str] | None = None) -> tune.ExperimentAnalysis:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=4)
    parser.add_argument("--horovod", action="store_true", help="each trial trains with Horovod instead of DDP")
    parser.add_argument("--pbt", action="store_true", help="Population Based Training instead of ASHA")
    parser.add_argument("--lightning", action="store_true", help="use the `lightning` package's Trainer")
    parser.add_argument("--storage-path", default=None, help="where Tune keeps results (default ~/ray_results)")
    args = parser.parse_args(argv)

    if not ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):
        # A trial needs 1 CPU for itself plus one per worker; on a small laptop, let the local Ray
        # count more logical CPUs than there are cores so at least one trial fits (the trial's own
        # process mostly waits). Tune's trial processes import `examples.train_digits` by name:
        # give them this checkout.
        ray.init(
            num_cpus=max(os.cpu_count() or 1, 1 + args.num_workers),
            runtime_env={"env_vars": {"PYTHONPATH": ROOT, "DIGITS_LIGHTNING": pl.__name__}},
        )
    config = {
        "hidden": tune.choice([32, 64, 128]),
        "lr": tune.loguniform(1e-3, 1e-1),
        "batch_size": tune.choice([32, 64, 128]),
    }
    analysis = tune.run(
        tune.with_parameters(
            train_digits, num_workers=args.num_workers, max_epochs=args.max_epochs, horovod=args.horovod
        ),
        metric="loss",
        mode="min",
        config=config,
        num_samples=args.num_samples,
        scheduler=scheduler_for(args),
        resources_per_trial=get_tune_resources(num_workers=args.num_workers),
        reuse_actors=True,  # the next trial starts on the workers of the one before
        storage_path=args.storage_path,
        name="tune_digits",
        verbose=1,
    )
    print("Best hyperparameters found were: ", analysis.best_config)
    best = analysis.best_result
    print(f"Best trial: loss {best['loss']:.4f}, acc {best['acc']:.4f} after {best['training_iteration']} epoch(s)")
    with analysis.best_checkpoint.as_directory() as directory:
        model = DigitsClassifier.load_from_checkpoint(os.path.join(directory, "checkpoint"))
    print(f"Reloaded the best checkpoint: hidden={model.hparams.hidden}, lr={model.hparams.lr:.4g}")
    return analysis


if __name__ == "__main__":
    main()
