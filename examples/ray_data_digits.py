"""Stream a Ray Data dataset into 2 Ray workers with RayDataModule: preprocessing runs as Ray Data tasks
wherever Ray finds CPUs, each worker trains on its own share, and the metrics come back.

    python3 dev.py example --data                  # via the project's command (sets up .venv)
    python examples/ray_data_digits.py --num-workers 4 --max-epochs 10
    RAY_ADDRESS=auto python examples/ray_data_digits.py   # on a running Ray cluster

The data is scikit-learn's bundled 8x8 digits (nothing is downloaded), put into Ray's object store; on a
cluster you would read it from storage instead (``ray.data.read_parquet("s3://...")``).
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import pytorch_lightning as pl
import ray
import torch
from torch import nn
from torch.nn import functional as F

from ray_lightning import RayStrategy
from ray_lightning.data import RayDataModule


def augment(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The per-row preprocessing, run by Ray Data tasks: scale to [0, 1] and add a little pixel noise."""
    pixels = batch["pixels"].astype(np.float32) / 16.0
    noise = np.random.default_rng().normal(0.0, 0.05, pixels.shape).astype(np.float32)
    return {"pixels": np.clip(pixels + noise, 0.0, 1.0), "label": batch["label"]}


def digits() -> tuple[ray.data.Dataset, ray.data.Dataset]:
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.RandomState(0).permutation(len(data.target))
    pixels, labels = data.data[order].astype(np.float32), data.target[order].astype(np.int64)
    train = ray.data.from_numpy(pixels[:1400]).rename_columns({"data": "pixels"})
    train = train.zip(ray.data.from_numpy(labels[:1400]).rename_columns({"data": "label"})).materialize()
    val = ray.data.from_items([{"pixels": p / 16.0, "label": y} for p, y in zip(pixels[1400:], labels[1400:])])
    return train.map_batches(augment), val


class DigitsClassifier(pl.LightningModule):
    def __init__(self, hidden: int = 64, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def training_step(self, batch, batch_idx):
        # A RayDataModule batch: one tensor per column.
        loss = F.cross_entropy(self.net(batch["pixels"]), batch["label"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self.net(batch["pixels"].float())
        rows = len(batch["label"])
        self.log("val_loss", F.cross_entropy(logits, batch["label"]), sync_dist=True, batch_size=rows)
        self.log("val_acc", (logits.argmax(1) == batch["label"]).float().mean(), sync_dist=True, batch_size=rows)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main(argv: list[str] | None = None) -> pl.Trainer:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)

    pl.seed_everything(0)
    if not ray.is_initialized() and "RAY_ADDRESS" not in os.environ:
        # A local Ray with a CPU for Ray Data's tasks beside each worker's, also on a small machine.
        ray.init(num_cpus=max(os.cpu_count() or 1, 2 * args.num_workers))
    train, val = digits()
    datamodule = RayDataModule(train=train, val=val, batch_size=args.batch_size)
    trainer = pl.Trainer(
        max_epochs=args.max_epochs,
        strategy=RayStrategy(num_workers=args.num_workers),
        callbacks=[pl.callbacks.TQDMProgressBar()],
        enable_checkpointing=False,
    )
    trainer.fit(DigitsClassifier(), datamodule=datamodule)
    print("\nFinal validation metrics (from the workers):")
    for name in ("val_loss", "val_acc"):
        print(f"  {name} = {float(trainer.callback_metrics[name]):.4f}")
    print(f"  epochs = {trainer.current_epoch}, optimizer steps = {trainer.global_step}")
    return trainer


if __name__ == "__main__":
    main()
