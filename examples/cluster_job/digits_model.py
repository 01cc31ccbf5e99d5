"""The training code of the cluster job, kept in a module of its own that ``train.py`` imports by name.

Ray's workers unpickle :class:`DigitsCNN` and :class:`DigitsImages` by importing ``digits_model``,
so on every node this file must be importable: ``train.py`` ships it with the job (see
``connect_to_ray`` there). The data is scikit-learn's bundled 8x8 digits, read as 1-channel
images; nothing is downloaded.
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class DigitsImages(pl.LightningDataModule):
    """The 1,797 digits as ``(N, 1, 8, 8)`` images, split into stratified train and validation sets."""

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.25, seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        images, labels = load_digits(return_X_y=True)
        train_x, val_x, train_y, val_y = train_test_split(
            images, labels, test_size=self.val_fraction, stratify=labels, random_state=self.seed
        )
        self.train_set = self._tensors(train_x, train_y)
        self.val_set = self._tensors(val_x, val_y)

    @staticmethod
    def _tensors(x, y) -> TensorDataset:
        pixels = torch.as_tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        return TensorDataset(pixels, torch.as_tensor(y, dtype=torch.long))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=2 * self.batch_size)


class DigitsCNN(pl.LightningModule):
    """Two small convolutions and a linear head; logs ``val_acc`` and ``val_loss`` averaged over all workers."""

    def __init__(self, channels: int = 16, lr: float = 3e-3, weight_decay: float = 1e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(channels * 4 * 4, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).flatten(1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        accuracy = (logits.argmax(dim=1) == labels).float().mean()
        self.log_dict({"val_loss": F.cross_entropy(logits, labels), "val_acc": accuracy}, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
