"""A user's driver script connected through Ray Client; run by tests/test_cluster_cli.py in its own process.

    python tests/ray_client_driver.py ray://HOST:PORT RUNS.json

Connects once, then runs each fit RUNS.json lists (``{"workdir", "summary", "resources", "relative"}``),
and a Fabric launch after it,
one after another as a user's session would: from ``workdir`` as its working directory, it trains on
2 Ray workers (each reserving ``resources``, which picks the node they run on) with a
ModelCheckpoint, a CSVLogger and a TensorBoardLogger whose save_dir is ``logs/`` in that working
directory: as an absolute path, or with ``relative`` as the relative path users often write. It
checks nothing itself: it writes what a user would look at on this machine into each run's
``summary`` file, and the tests assert on those.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import traceback

import pytorch_lightning as pl
import ray
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from ray_lightning import RayStrategy


class LineFit(pl.LightningModule):
    """Fits y = 3x - 1 on generated data; defined in the driver script, so Ray ships it by value."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.line = nn.Linear(1, 1)
        # 2 MB: travels beside the payload (launch.weights_out), also from a Ray Client; last.ckpt holds
        # the workers' copy, which the test compares with the driver's module.
        self.register_buffer("table", torch.arange(2**19, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.line(x)

    def _data(self, seed: int) -> DataLoader:
        x = torch.rand(64, 1, generator=torch.Generator().manual_seed(seed))
        return DataLoader(TensorDataset(x, 3 * x - 1), batch_size=8)

    def train_dataloader(self) -> DataLoader:
        return self._data(0)

    def val_dataloader(self) -> DataLoader:
        return self._data(1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def train(save_dir: str, resources: dict[str, float]) -> dict:
    pl.seed_everything(0)
    model = LineFit()
    before = [p.detach().clone() for p in model.parameters()]
    checkpoint = ModelCheckpoint(monitor="val_loss", save_last=True)
    loggers = [CSVLogger(save_dir=save_dir, name="csv"), TensorBoardLogger(save_dir=save_dir, name="tb")]
    trainer = pl.Trainer(
        max_epochs=2,
        strategy=RayStrategy(num_workers=2, resources_per_worker=resources),
        callbacks=[checkpoint],
        logger=loggers,
        log_every_n_steps=1,
        enable_progress_bar=False,
    )
    trainer.fit(model)

    best = checkpoint.best_model_path
    summary: dict = {
        "client_mode": ray.util.client.ray.is_connected(),
        "weights_changed": any(not torch.equal(b, p) for b, p in zip(before, model.parameters())),
        # The workers trained with the buffer they were sent, and sent it back.
        "table_intact": torch.equal(model.table, torch.arange(2**19, dtype=torch.float32)),
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "current_epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "best_model_path": best,
        "best_model_abs": os.path.abspath(best) if best else "",
        "best_is_file": bool(best) and os.path.isfile(best),
        "last_model_path": checkpoint.last_model_path,
        "transferred_files": list(getattr(trainer.strategy._launcher, "transferred_files", [])),
        "log_dirs": {type(lg).__name__: lg.log_dir for lg in trainer.loggers},
        "cwd": os.getcwd(),
    }
    try:
        summary["restored_lr"] = LineFit.load_from_checkpoint(best).hparams.lr
        last = LineFit.load_from_checkpoint(checkpoint.last_model_path)
        summary["last_matches_model"] = all(
            torch.equal(a, b) for a, b in zip(last.state_dict().values(), model.state_dict().values())
        )
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        summary["restore_error"] = traceback.format_exc()
    csv_dir = trainer.loggers[0].log_dir
    metrics_csv = os.path.join(csv_dir, "metrics.csv")
    summary["metrics_csv"] = metrics_csv
    summary["metrics_csv_text"] = open(metrics_csv).read() if os.path.isfile(metrics_csv) else None
    summary["tb_events"] = glob.glob(os.path.join(trainer.loggers[1].log_dir, "events.out.tfevents.*"))
    return summary


def fabric_loop(fabric, lr: float) -> dict:
    """A Fabric user's loop, defined in the driver script (shipped by value); saves with a relative path."""
    fabric.seed_everything(0)
    model = nn.Linear(1, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=lr))
    x = torch.rand(16, 1, generator=torch.Generator().manual_seed(0))
    for _ in range(4):
        fabric.backward(F.mse_loss(model(x), 3 * x - 1))
        optimizer.step()
        optimizer.zero_grad()
    fabric.save("fabric/state.ckpt", {"model": model, "step": 4})
    return {"world_size": fabric.world_size, "node": ray.get_runtime_context().get_node_id()}


def train_fabric(resources: dict[str, float]) -> dict:
    """``fabric.launch`` under Ray Client, with the other Lightning package's Fabric (lightning_fabric)."""
    import lightning_fabric

    fabric = lightning_fabric.Fabric(strategy=RayStrategy(num_workers=2, resources_per_worker=resources))
    result = fabric.launch(fabric_loop, 0.1)
    path = os.path.abspath("fabric/state.ckpt")
    return {
        "result": result,
        "checkpoint_step": torch.load(path, weights_only=False)["step"] if os.path.isfile(path) else None,
        "transferred_files": list(fabric.strategy.launcher.transferred_files),
        "checkpoint": path,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("runs", help="a JSON file: a list of {workdir, summary, resources, relative}")
    args = parser.parse_args()
    with open(args.runs) as f:
        runs = json.load(f)
    try:
        ray.init(args.address)
    except BaseException:  # noqa: BLE001 - the test reads what went wrong from the summary
        summaries = [{"error": traceback.format_exc(), "stage": "connect"}] * len(runs)
        for run, summary in zip(runs, summaries):
            _write(run["summary"], summary)
        return
    for run in runs:
        os.chdir(run["workdir"])
        try:
            summary = train("logs" if run["relative"] else os.path.abspath("logs"), run["resources"])
        except BaseException:  # noqa: BLE001 - as above
            summary = {"error": traceback.format_exc(), "stage": "fit"}
        try:
            summary["fabric"] = train_fabric(run["resources"])
        except BaseException:  # noqa: BLE001 - as above
            summary["fabric"] = {"error": traceback.format_exc()}
        _write(run["summary"], summary)
    ray.shutdown()


def _write(path: str, summary: dict) -> None:
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
