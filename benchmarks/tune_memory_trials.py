"""What runs inside the trials of :mod:`benchmarks.tune_memory`: the workload, each process's peak sampled into a
file, and each contender's trial function (ray_lightning's plain ``trainer.fit``; Ray Train v2 driven from the
trial as Ray documents it)."""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def watch_peak(path: Path) -> None:
    """Writes this process's peak RSS (MB) to ``path`` now and every 0.25 s after, from a daemon thread."""

    def write() -> None:  # whole or not at all: the harness may read it while this process still runs
        path.with_suffix(".tmp").write_text(str(_peak_mb()))
        os.replace(path.with_suffix(".tmp"), path)

    def loop() -> None:
        while True:
            write()
            time.sleep(0.25)

    write()
    threading.Thread(target=loop, daemon=True, name="peak-rss").start()


def _module(config: dict[str, Any]) -> Any:
    """The workload: ``config["layers"]`` square linear layers of ``config["dim"]``, Adam, a loss to minimise."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.workload import pl  # Ray Train's namespace, for every contender

    dim, layers = config["dim"], config["layers"]

    class Wide(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers: nn.Module | None = None
            if not config.get("in_configure_model"):
                self.configure_model()

        def configure_model(self) -> None:
            if self.layers is None:
                self.layers = nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(layers)))
                if config.get("fully_shard"):  # under Lightning's ModelParallelStrategy, which shards nothing itself
                    from torch.distributed.fsdp import fully_shard

                    for layer in self.layers:
                        fully_shard(layer, mesh=self.device_mesh["data_parallel"])
                    fully_shard(self.layers, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.layers(x).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            (x,) = batch
            self.log("val_loss", self.layers(x).pow(2).mean(), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=config.get("lr", 1e-4))

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(16, dim)), batch_size=4)

        def val_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(8, dim)), batch_size=4)

    return Wide()


def _rank_peak(peaks: str, trial_id: str) -> Any:
    """A callback: each rank samples its peak into ``rank<r>-<pid>`` and notes the step its fit began at."""
    from benchmarks.workload import pl  # Ray Train's namespace, for every contender

    class RankPeak(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            watch_peak(Path(peaks, f"rank{trainer.global_rank}-{os.getpid()}"))

        def on_train_start(self, trainer, pl_module):
            with open(Path(peaks, "starts.jsonl"), "a") as f:
                f.write(json.dumps({"trial": trial_id, "rank": trainer.global_rank, "step": trainer.global_step}))
                f.write("\n")

    return RankPeak()


def _trial_begins(config: dict[str, Any]) -> str:
    """The trial's function begins: its process's peak is sampled, a restore's checkpoint files are noted."""
    from ray import tune

    trial_id = tune.get_context().get_trial_id()
    watch_peak(Path(config["peaks"], f"trial-{os.getpid()}"))
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with open(Path(config["peaks"], "restores.jsonl"), "a") as f:
            files = sorted(str(p.relative_to(checkpoint.path)) for p in Path(checkpoint.path).rglob("*") if p.is_file())
            f.write(json.dumps({"trial": trial_id, "files": files}) + "\n")
    return trial_id


def train(config: dict) -> None:
    """A ray_lightning trial's function: one plain ``trainer.fit``, which resumes a restored trial itself."""
    from ray import tune

    import ray_lightning.tune as rl_tune
    from benchmarks.workload import pl  # Ray Train's namespace, for every contender
    from ray_lightning import RayFSDPStrategy
    from ray_lightning.tune import trial

    trial_id = _trial_begins(config)
    if config["mode"] == "through_trial":
        # The path taken where fsspec cannot reach Tune's storage.
        trial.ranks_write_to_tune_storage = lambda *args: False
    report = (
        rl_tune.TuneReportCallback({"loss": "val_loss"})
        if config["mode"] == "metrics"
        else rl_tune.TuneReportCheckpointCallback({"loss": "val_loss"})
    )
    trainer = pl.Trainer(
        max_epochs=config["epochs"],
        strategy=RayFSDPStrategy(num_workers=2, keep_workers_alive_s=0, full_weights_home=False),
        callbacks=[report, _rank_peak(config["peaks"], trial_id)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    started = time.perf_counter()
    trainer.fit(_module(config))
    if not config.get("pbt"):
        tune.report({"trial_peak_mb": _peak_mb(), "fit_s": time.perf_counter() - started})


def _ray_train_loop(config: dict) -> None:
    """Ray Train's ``train_loop_per_worker`` as its Lightning guide writes it, resuming from its own checkpoint."""
    import ray.train
    from ray.train.lightning import RayLightningEnvironment, RayTrainReportCallback

    from benchmarks.workload import fit_from_ray_train_checkpoint, pl  # pl: Ray Train's namespace, for every contender

    # Ray's documented FSDP (ray.train.lightning.RayFSDPStrategy) is FSDP1, which torch refuses on a CPU ("FSDP
    # needs a non-CPU accelerator device"); its FSDP2 is Lightning's ModelParallelStrategy, in Ray's Lightning
    # environment. prepare_trainer would only refuse the class, so it is not called.
    trainer = pl.Trainer(
        max_epochs=config["epochs"],
        strategy=pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        plugins=[RayLightningEnvironment()],
        accelerator="cpu",
        devices=ray.train.get_context().get_local_world_size(),  # its root device is devices[local_rank]
        callbacks=[RayTrainReportCallback(), _rank_peak(config["peaks"], config["trial_id"])],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    fit_from_ray_train_checkpoint(trainer, _module({**config, "fully_shard": True}))


def ray_train_trial(config: dict) -> None:
    """A trial as Ray documents Tune + Train v2: the function drives a ``TorchTrainer`` named after the trial."""
    import ray.train
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    trial_id = _trial_begins(config)
    TorchTrainer(
        _ray_train_loop,
        train_loop_config={**config, "trial_id": trial_id},
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(
            name=f"train-{trial_id}",
            storage_path=os.path.join(config["scratch"], "ray_train"),
            callbacks=[TuneReportCallback()],
        ),
    ).fit()
