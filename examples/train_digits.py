"""Train a digits classifier on 2 Ray workers with DDP (or Horovod) and print the metrics that came back.

    python3 dev.py example                       # via the project's command (sets up .venv)
    python3 dev.py example --horovod             # the same with HorovodRayAccelerator (builds Horovod once)
    python3 dev.py example --lightning           # the same with `import lightning.pytorch as pl`
    python examples/train_digits.py --num-workers 4 --max-epochs 10
    RAY_ADDRESS=auto python examples/train_digits.py   # on a running Ray cluster

With no Ray running, a local Ray is started on the spot. The data is scikit-learn's bundled 8x8
digits, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from ray_lightning import HorovodRayAccelerator, RayAccelerator, RayStrategy

# ray_lightning works with both Lightning packages. This example uses `pytorch_lightning`, or with
# `--lightning` the `lightning` package (`import lightning.pytorch as pl`). The choice is kept in an
# environment variable so that Ray Tune's trial processes, which import this module, make it too.
if "--lightning" in sys.argv:
    os.environ["DIGITS_LIGHTNING"] = "lightning.pytorch"
pl = importlib.import_module(os.environ.get("DIGITS_LIGHTNING", "pytorch_lightning"))


class DigitsDataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
        y = torch.tensor(digits.target, dtype=torch.long)
        order = torch.from_numpy(np.random.RandomState(0).permutation(len(x)))
        x, y = x[order], y[order]
        self.train_set, self.val_set = TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class DigitsClassifier(pl.LightningModule):
    def __init__(self, hidden: int = 64, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=5)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument(
        "--accelerator-form",
        action="store_true",
        help="use Trainer(accelerator=RayAccelerator(...)) instead of strategy=RayStrategy(...)",
    )
    parser.add_argument("--horovod", action="store_true", help="train with Horovod instead of DDP")
    parser.add_argument("--lightning", action="store_true", help="use the `lightning` package's Trainer")
    args = parser.parse_args()

    pl.seed_everything(0)
    model = DigitsClassifier()
    checkpoint = pl.callbacks.ModelCheckpoint(monitor="val_acc", mode="max")
    if args.accelerator_form or args.horovod:
        accelerator_class = HorovodRayAccelerator if args.horovod else RayAccelerator
        ray_kwargs = dict(
            accelerator=accelerator_class(num_workers=args.num_workers, cpus_per_worker=1, use_gpu=args.use_gpu)
        )
    else:
        ray_kwargs = dict(strategy=RayStrategy(num_workers=args.num_workers, use_gpu=args.use_gpu))
    print(f"Training with {type(ray_kwargs.get('strategy') or ray_kwargs['accelerator']).__name__}")
    # TQDMProgressBar: the bar the driver draws live (where `rich` is installed, Lightning's default
    # RichProgressBar would only print its final state from the worker).
    callbacks = [checkpoint, pl.callbacks.TQDMProgressBar()]
    trainer = pl.Trainer(max_epochs=args.max_epochs, callbacks=callbacks, **ray_kwargs)
    trainer.fit(model, datamodule=DigitsDataModule())

    # Everything below ran on the workers and came back to this process.
    print("\nFinal validation metrics (from the workers):")
    for name in ("val_loss", "val_acc"):
        print(f"  {name} = {float(trainer.callback_metrics[name]):.4f}")
    print(f"  epochs = {trainer.current_epoch}, optimizer steps = {trainer.global_step}")
    print(f"  best checkpoint = {checkpoint.best_model_path} (val_acc {float(checkpoint.best_model_score):.4f})")
    best = DigitsClassifier.load_from_checkpoint(checkpoint.best_model_path)
    print(f"  reloaded best model with hidden={best.hparams.hidden}")


if __name__ == "__main__":
    main()
