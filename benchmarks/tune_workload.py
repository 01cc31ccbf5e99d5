"""What the Tune benchmark's trials train: a small classifier on teacher-labelled synthetic data, with a held-out set.

Every process builds the same data from the spec's seed (nothing is shipped): Gaussian inputs labelled by a fixed
random teacher network, so the labels have structure a student learns and validation accuracy depends on the
learning rate (SGD with momentum: too small learns little within the budget, too large diverges).
:class:`TrialClock` writes, from rank 0, when a trial's training reached its first batch.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.workload import Spec, mlp, pl


@dataclass
class TuneSpec(Spec):
    """The search's sizes; ``steps`` is the optimizer steps between two reports (one Lightning epoch)."""

    batch_size: int = 64
    features: int = 32
    hidden: int = 128
    classes: int = 8
    steps: int = 40
    trials: int = 4  # PBT's population (num_samples)
    reports: int = 8  # per trial: the budget is reports * steps optimizer steps
    interval: int = 2  # PBT's perturbation_interval, in training_iteration (reports)
    # Seeds Tune's and PBT's draws: initial learning rates 0.0046, 0.41, 0.0042, 0.57 (the best, ~0.01-0.03, is not
    # among them: PBT has to find it).
    search_seed: int = 5
    train_size: int = 8192
    val_size: int = 2048
    lr_min: float = 1e-3
    lr_max: float = 1.0

    @classmethod
    def tiny(cls) -> TuneSpec:
        """Every code path (an exploit, a second trial start) in seconds of compute."""
        return cls(hidden=32, steps=20, trials=2, reports=4, interval=1, train_size=1024, val_size=256, smoke=True)

    @property
    def cluster_cpus(self) -> int:
        # The whole population trains at once, as PBT means: per trial its own process and its workers, what
        # get_tune_resources reserves and what Ray documents for a Tune function that starts a Train run (the
        # function's default 1 CPU, the workers' in Train's own placement group; the controller takes none).
        return self.trials * (1 + self.workers)


def _dataset(spec: TuneSpec, size: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(spec.seed)
    teacher_in = torch.randn(spec.features, 64, generator=g) / spec.features**0.5
    teacher_out = torch.randn(64, spec.classes, generator=g)
    x = torch.randn(size, spec.features, generator=torch.Generator().manual_seed(seed))
    y = (torch.tanh(x @ teacher_in) @ teacher_out).argmax(dim=1)
    return TensorDataset(x, y)


class TuneModule(pl.LightningModule):
    """An MLP classifier; ``lr`` (the searched hyperparameter) goes to SGD in ``configure_optimizers``."""

    def __init__(self, spec: TuneSpec, lr: float) -> None:
        super().__init__()
        self.spec, self.lr = spec, lr
        torch.manual_seed(spec.seed)  # the same initial weights in every trial, rank and contender
        self.net = mlp(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        # Averaged over the ranks' shards: every rank sees the same numbers, rank 0 reports them.
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        data = _dataset(self.spec, self.spec.train_size, self.spec.seed + 1)
        return DataLoader(data, batch_size=self.spec.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_dataset(self.spec, self.spec.val_size, self.spec.seed + 2), batch_size=256)


def trainer_kwargs(spec: TuneSpec) -> dict[str, Any]:
    """The Trainer arguments of both contenders: an epoch of ``steps`` batches, validation and a report after each."""
    return dict(
        max_epochs=spec.reports,
        limit_train_batches=spec.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def append_record(path: str, record: dict[str, Any]) -> None:
    """One JSON line in one ``write`` (O_APPEND): trials and ranks of several processes share the file."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def read_records(path: str) -> list[dict[str, Any]]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class TrialClock(pl.Callback):
    """Rank 0 appends ``{"token", "first_batch"}`` to ``path`` when this fit's first batch starts: the end of a trial
    start, which the trial's function began by writing ``{"token", "start"}``."""

    def __init__(self, path: str, token: str) -> None:
        self.path, self.token = path, token
        self._done = False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if self._done or trainer.global_rank != 0:
            return
        self._done = True
        append_record(self.path, {"token": self.token, "first_batch": time.time(), "rank0_pid": os.getpid(),
                                  "global_step": trainer.global_step})  # fmt: skip
