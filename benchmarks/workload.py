"""What every contender trains: the sizes, the LightningModules, the synthetic data and the step clock.

Everything is generated from a fixed seed in the process that needs it, so no data is shipped and
every contender (and every rank) sees the same numbers.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import JsonSpec, write_whole

# Ray Train's Lightning utilities use `lightning.pytorch` whenever the `lightning` package is
# installed, and its strategy is refused by a `pytorch_lightning` Trainer (ray-project/ray#47089).
# Every contender uses that same namespace, so all of them train the same module.
try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

# The frozen block of the weights-back model is split into tensors of this many elements, as a real
# model's state dict has many tensors rather than one.
_FROZEN_CHUNK = 10_000_000


@dataclass
class Spec(JsonSpec):
    """The sizes of one benchmark run; sent as JSON to each driver process."""

    workers: int = 2
    batch_size: int = 128
    features: int = 512
    hidden: int = 1024
    classes: int = 16
    # Optimizer steps per fit on each worker; the step time is the median after `warmup` of them.
    steps: int = 60
    warmup: int = 10
    # Parameters (float32) of the model whose weights come back to the driver; most are frozen.
    weights_params: int = 250_000_000
    weights_steps: int = 2
    seed: int = 0
    # Set by the harness: the Ray cluster to connect to and a directory for clock files and Ray Train's storage.
    ray_address: str = ""
    scratch: str = ""
    # Tiny sizes (the smoke tests'): what only costs time goes (`benchmarks.measure.measurement_main`), and the
    # weights-back fit is the second fit (`benchmarks.measure.fit_plan`).
    smoke: bool = False

    @classmethod
    def tiny(cls) -> Spec:
        """Sizes for the smoke test: every code path, seconds of compute."""
        return cls(batch_size=16, features=32, hidden=64, classes=4, steps=6, warmup=2, weights_params=1_000_000,
                   smoke=True)  # fmt: skip


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mlp(spec: Any) -> nn.Sequential:
    """The benchmarks' MLP: ``features`` → ``hidden`` → ``hidden`` → ``classes``, ReLU between."""
    return nn.Sequential(
        nn.Linear(spec.features, spec.hidden),
        nn.ReLU(),
        nn.Linear(spec.hidden, spec.hidden),
        nn.ReLU(),
        nn.Linear(spec.hidden, spec.classes),
    )


class BenchModule(pl.LightningModule):
    """An MLP classifier on synthetic data; a step is tens of milliseconds of compute at the default sizes."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        g = _seeded(spec.seed)
        self.net = mlp(spec)
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        spec = self.spec
        # Enough samples for `steps` batches on every worker; the sampler splits them between ranks.
        size = spec.batch_size * spec.workers * max(spec.steps, spec.weights_steps)
        g = _seeded(spec.seed + 1)
        x = torch.randn(size, spec.features, generator=g)
        y = torch.randint(0, spec.classes, (size,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=spec.batch_size, shuffle=True)


class WeightsModule(BenchModule):
    """:class:`BenchModule` plus a frozen block, ``spec.weights_params`` float32 parameters in all.

    The frozen parameters are in the state dict (so they travel back to the driver) but take no
    gradient, so training stays cheap on a small machine.
    """

    def __init__(self, spec: Spec) -> None:
        super().__init__(spec)
        remaining = max(spec.weights_params - sum(p.numel() for p in self.net.parameters()), 1)
        chunks = math.ceil(remaining / _FROZEN_CHUNK)
        g = _seeded(spec.seed + 2)
        sizes = [_FROZEN_CHUNK] * (chunks - 1) + [remaining - _FROZEN_CHUNK * (chunks - 1)]
        self.frozen = nn.ParameterList(nn.Parameter(torch.randn(n, generator=g), requires_grad=False) for n in sizes)


def trainer_kwargs(spec: Spec, steps: int) -> dict[str, Any]:
    """The Trainer arguments every contender uses (the strategy and devices come on top)."""
    return dict(
        max_epochs=1,
        limit_train_batches=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def ray_train_trainer(arguments: dict[str, Any], callbacks: list[Any]) -> Any:
    """Inside Ray Train's ``train_loop_per_worker``: every Ray Train contender's Trainer (``RayDDPStrategy``,
    ``RayLightningEnvironment``, on the CPU) with ``arguments`` and ``callbacks``, through ``prepare_trainer``."""
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

    trainer = pl.Trainer(**arguments, strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()],
                         accelerator="cpu", devices="auto", callbacks=callbacks)  # fmt: skip
    return prepare_trainer(trainer)


def fit_from_ray_train_checkpoint(trainer: Any, module: Any) -> None:
    """Inside Ray Train's ``train_loop_per_worker``: ``trainer.fit(module)``, resuming from
    ``ray.train.get_checkpoint()`` (a ``RayTrainReportCallback`` checkpoint) as Ray's Lightning guide shows."""
    import ray.train
    from ray.train.lightning import RayTrainReportCallback

    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as directory:
            trainer.fit(module, ckpt_path=os.path.join(directory, RayTrainReportCallback.CHECKPOINT_NAME))
    else:
        trainer.fit(module)


class StepClock(pl.Callback):
    """Records rank 0's wall-clock times during ``fit`` and writes them to ``path`` in ``on_fit_end``.

    Every contender runs on this one machine, so these times compare with the driver's
    ``time.time()``. A file works the same for every contender, also where nothing else comes back
    from the workers (Ray Train).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fit_start: float | None = None
        self.first_batch_start: float | None = None
        self.first_optimizer_step: float | None = None
        self.batch_ends: list[float] = []
        # CPU seconds of rank 0's process (all its threads) at each batch end: a step's cost that
        # waiting for a busy machine's cores does not inflate.
        self.batch_end_cpu: list[float] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fit_start = time.time()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if self.first_batch_start is None:
            self.first_batch_start = time.time()

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.first_optimizer_step is None:
            self.first_optimizer_step = time.time()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if pl_module.device.type == "cuda":
            # CUDA runs ahead of Python: wait for the step's kernels, so that a batch end is when the step was done.
            torch.cuda.synchronize(pl_module.device)
        self.batch_ends.append(time.time())
        self.batch_end_cpu.append(time.process_time())

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fit_end = time.time()
        if trainer.global_rank != 0:
            return
        record = {
            "fit_start": self.fit_start,
            "first_batch_start": self.first_batch_start,
            "first_optimizer_step": self.first_optimizer_step,
            "batch_ends": self.batch_ends,
            "batch_end_cpu": self.batch_end_cpu,
            "fit_end": fit_end,
            "world_size": trainer.world_size,
            "threads": torch.get_num_threads(),
            "pid": os.getpid(),
        }
        write_whole(self.path, record)


def read_clock(path: str) -> dict[str, Any]:
    """Rank 0's record of one fit; fails naming the file when rank 0 never wrote it."""
    if not os.path.isfile(path):
        raise RuntimeError(f"rank 0 wrote no step clock at {path}: on_fit_end did not run on rank 0")
    with open(path) as f:
        return json.load(f)
