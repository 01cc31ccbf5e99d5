"""One data-benchmark measurement: a fresh driver process runs one contender's fit and writes what it saw.

    python -m benchmarks.data_driver --contender ray_data --spec spec.json --result result.json

Started by :mod:`benchmarks.data`, once per contender and repeat. The driver connects to the harness's Ray
cluster before any timer starts, then trains :class:`TinyConvNet` for one epoch of ``spec.rows`` generated
images, each row preprocessed on the CPU by :func:`~benchmarks.data_rows.preprocess_row` (the same function,
the same rows, in every contender): as a Ray Data ``map_batches`` (RayDataModule, Ray Train) or in a torch
``Dataset.__getitem__`` (plain DataLoader). Every rank runs :class:`DataClock` (each batch's start and end, its
process's CPU time); rank 0 also snapshots the CPU time of every process of the Ray node at the end of the
warm-up and at the last step (:func:`~benchmarks.data_cpu.node_cpu`). Every process is on one machine, so all
``time.time()`` compare.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from benchmarks import data_restart, read_ranks, write_whole
from benchmarks.data_cpu import coordinating_s_per_gb, cpu_breakdown, node_cpu, row_bytes
from benchmarks.data_rows import DataSpec, image_dataset, label, preprocess_row
from benchmarks.measure import _peak_rss_mb, measurement_main
from benchmarks.workload import pl, trainer_kwargs


class ImageRows(torch.utils.data.Dataset):
    """The plain DataLoader contender's map-style dataset: :func:`preprocess_row` in ``__getitem__``, or the rows
    computed beforehand (``ready``: the data ready, the transport alone)."""

    def __init__(self, spec: DataSpec, ready: torch.Tensor | None = None) -> None:
        self.spec, self.ready = spec, ready

    def __len__(self) -> int:
        return self.spec.rows

    def __getitem__(self, i: int) -> dict[str, Any]:
        image = self.ready[i] if self.ready is not None else torch.from_numpy(preprocess_row(i, self.spec))
        return {"image": image, "label": label(i, self.spec)}


class LoaderData(pl.LightningDataModule):
    """A torch ``DataLoader`` over :class:`ImageRows` in each rank, ``spec.loader_workers`` loader processes;
    Lightning gives it a ``DistributedSampler`` (each rank its half, shuffled). With ``spec.ready`` each rank
    computes every row in ``setup`` (before ``on_fit_start``)."""

    def __init__(self, spec: DataSpec) -> None:
        super().__init__()
        self.spec = spec
        self.ready: torch.Tensor | None = None

    def setup(self, stage: str) -> None:
        if self.spec.ready:
            self.ready = torch.stack([torch.from_numpy(preprocess_row(i, self.spec)) for i in range(self.spec.rows)])

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        spec = self.spec
        return torch.utils.data.DataLoader(ImageRows(spec, self.ready), batch_size=spec.batch_size, shuffle=True,
                                           drop_last=True, num_workers=spec.loader_workers)  # fmt: skip


# -- The model and the clock ---------------------------------------------------------------------------------


class TinyConvNet(pl.LightningModule):
    """A conv layer (3→8, stride 2), global average pooling and a linear classifier: a step of a few ms, so the
    data path dominates."""

    def __init__(self, spec: DataSpec) -> None:
        super().__init__()
        torch.manual_seed(spec.seed)
        self.conv = nn.Conv2d(spec.channels, 8, 3, stride=2, padding=1)
        self.head = nn.Linear(8, spec.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(F.relu(self.conv(x)), 1).flatten(1))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch["image"]), batch["label"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class DataClock(pl.Callback):
    """In every rank: each training batch's start and end (``time.time()``) and the process's CPU time at each
    end; rank 0 also :func:`node_cpu` at the end of step ``warmup`` and of step ``steps``. Writes
    ``<prefix>.rank<N>.json`` in ``on_fit_end``.

    The gap between a batch's end and the next one's start is the time the rank waited for its next batch
    (Lightning fetches it between the two hooks)."""

    def __init__(self, prefix: str, warmup: int, steps: int) -> None:
        self.prefix, self.warmup, self.steps = prefix, warmup, steps
        self.fit_start: float | None = None
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.cpu: list[float] = []
        self.snapshots: list[dict[str, Any]] = []
        self.first_batch: dict[str, Any] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fit_start = time.time()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        self.starts.append(time.time())
        if not self.first_batch:
            self.first_batch = {k: [list(v.shape), str(v.dtype)] for k, v in batch.items() if torch.is_tensor(v)}

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.ends.append(time.time())
        self.cpu.append(time.process_time())
        if trainer.global_rank == 0 and len(self.ends) in (self.warmup, self.steps):
            self.snapshots.append(node_cpu())

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
            "fit_start": self.fit_start,
            "fit_end": time.time(),
            "starts": self.starts,
            "ends": self.ends,
            "cpu": self.cpu,
            "snapshots": self.snapshots,
            "first_batch": self.first_batch,
        }
        write_whole(f"{self.prefix}.rank{trainer.global_rank}.json", record)


# -- The contenders ------------------------------------------------------------------------------------------


def _trainer_arguments(spec: DataSpec) -> dict[str, Any]:
    # The benchmarks' Trainer arguments (no logger, checkpoints, progress bar, summary or sanity check), one
    # epoch of `steps` steps.
    return {**trainer_kwargs(spec, spec.steps), "accelerator": "cpu"}  # type: ignore[arg-type]


def _ray_data_fit(shuffle: str | None) -> Callable[[DataSpec, str], None]:
    def fit(spec: DataSpec, prefix: str) -> None:
        from ray_lightning import RayStrategy
        from ray_lightning.data import RayDataModule

        data = RayDataModule(train=image_dataset(spec), batch_size=spec.batch_size, shuffle=shuffle)
        trainer = pl.Trainer(**_trainer_arguments(spec), strategy=RayStrategy(num_workers=spec.workers),
                             callbacks=[DataClock(prefix, spec.warmup, spec.steps)])  # fmt: skip
        trainer.fit(TinyConvNet(spec), datamodule=data)

    return fit


def _loader_fit(spec: DataSpec, prefix: str) -> None:
    from ray_lightning import RayStrategy

    trainer = pl.Trainer(**_trainer_arguments(spec), strategy=RayStrategy(num_workers=spec.workers),
                         callbacks=[DataClock(prefix, spec.warmup, spec.steps)])  # fmt: skip
    trainer.fit(TinyConvNet(spec), datamodule=LoaderData(spec))


def _ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: its Lightning recipe, the dataset shard's ``iter_torch_batches``
    as the training loader."""
    import ray.train
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

    spec = DataSpec.from_json(config["spec"])
    shard = ray.train.get_dataset_shard("train")
    batches = shard.iter_torch_batches(batch_size=spec.batch_size, drop_last=True)
    trainer = pl.Trainer(
        **_trainer_arguments(spec),
        strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        devices="auto",
        callbacks=[DataClock(config["prefix"], spec.warmup, spec.steps)],
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(TinyConvNet(spec), train_dataloaders=batches)


def _ray_train_fit(spec: DataSpec, prefix: str) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"spec": spec.to_json(), "prefix": prefix},
        scaling_config=ScalingConfig(num_workers=spec.workers, use_gpu=False),
        datasets={"train": image_dataset(spec)},
        run_config=RunConfig(storage_path=os.path.join(spec.scratch, "ray_train"), name=f"data-{uuid.uuid4().hex[:8]}"),
    )
    trainer.fit()


@dataclass(frozen=True)
class Contender:
    """One way to feed the workers: its name on the command line, its label in the tables, its ``fit``."""

    name: str
    label: str
    fit: Callable[[DataSpec, str], None]
    note: str = ""


CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in (
        Contender("ray_data", "ray_lightning RayDataModule(shuffle='local') + RayStrategy", _ray_data_fit("local"),
                  note="the default shuffle: rows mixed within windows of at least 2048 rows (consecutive blocks)"),
        Contender("ray_data_ordered", "ray_lightning RayDataModule(shuffle=None) + RayStrategy", _ray_data_fit(None),
                  note="dataset order, as Ray Train's iter_torch_batches here: the like-for-like comparison"),
        Contender("ray_train", "Ray Train TorchTrainer(datasets=...) + iter_torch_batches + RayDDPStrategy",
                  _ray_train_fit, note="Ray Train's documented Lightning recipe; get_dataset_shard('train')."
                  "iter_torch_batches(batch_size, drop_last=True), dataset order (no local shuffle buffer)"),
        Contender("torch_loader", "torch DataLoader(num_workers=N) per worker + RayStrategy", _loader_fit,
                  note="a map-style Dataset doing the same preprocessing in __getitem__; Lightning's "
                  "DistributedSampler (shuffled); N = loader_workers loader processes in each rank"),
        *(Contender(name, data_restart.LABELS[name],
                    (data_restart.restart_fit if name.startswith("restart") else data_restart.resume_fit)(name))
          for name in data_restart.FRACTIONS),
    )
}  # fmt: skip
# The contenders measured once per epoch's throughput (the others: a restart's or resume's times).
THROUGHPUT = ("ray_data", "ray_data_ordered", "ray_train", "torch_loader")
BASELINE = "ray_train"


# -- The measurement -------------------------------------------------------------------------------------------


def metrics(spec: DataSpec, t0: float, t1: float, ranks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """What one fit shows, from rank 0's clock: the whole epoch (from its ``on_fit_start``: every pipeline
    starts reading after it, so its ramp-up counts, the workers' launch does not) and the steady window (the
    steps after the warm-up, which a pipeline that preprocessed ahead during the ramp-up serves from memory)."""
    rank0 = ranks[0]
    starts, ends = rank0["starts"], rank0["ends"]
    n, w = len(ends), spec.warmup
    if n != spec.steps or len(starts) != n:
        raise RuntimeError(f"rank 0 ran {n} steps (batch starts: {len(starts)}), not {spec.steps}")
    window = ends[-1] - ends[w - 1]
    samples = (n - w) * spec.batch_size * spec.workers
    epoch = ends[-1] - rank0["fit_start"]

    def idle(record: dict[str, Any]) -> list[float]:
        return [record["starts"][k] - record["ends"][k - 1] for k in range(w, len(record["ends"]))]

    gaps = idle(rank0)
    steps = [ends[k] - starts[k] for k in range(w, n)]
    return {
        "epoch_samples_per_s": n * spec.batch_size * spec.workers / epoch,
        "samples_per_s": samples / window,
        "idle_ms": statistics.median(gaps) * 1000,
        "idle_mean_ms": statistics.mean(gaps) * 1000,
        # Everything in the epoch that was not a training step, per step: the wait for the first batch included.
        "idle_epoch_ms": (epoch - sum(e - s for s, e in zip(starts, ends))) / n * 1000,
        "idle_share_pct": sum(gaps) / window * 100,
        "step_ms": statistics.median(steps) * 1000,
        "step_cpu_ms": (rank0["cpu"][-1] - rank0["cpu"][w - 1]) / (n - w) * 1000,
        "setup_s": starts[0] - rank0["fit_start"],
        "first_batch_s": starts[0] - t0,
        "fit_s": t1 - t0,
        "other_ranks_idle_share_pct": [sum(idle(r)) / window * 100 for k, r in sorted(ranks.items()) if k],
        "epoch_s": epoch,
        "window_s": window,
        "window_samples": samples,
    }


def measure(contender: Contender, spec: DataSpec, result_path: str, record: bool = True) -> dict[str, Any]:
    """Connect to the harness's cluster, run the contender's fit, return its metrics (``record``: unused)."""
    import ray

    ray.init(address=spec.ray_address, log_to_driver=True)
    prefix = result_path
    if spec.ready:
        image_dataset(spec)  # materialized now, before any timer
    t0 = time.time()
    contender.fit(spec, prefix)
    t1 = time.time()
    ranks = read_ranks(prefix)
    if set(ranks) != set(range(spec.workers)):
        raise RuntimeError(f"clock files from ranks {sorted(ranks)}, not from all {spec.workers}")
    if contender.name in data_restart.FRACTIONS:
        times = data_restart.metrics(contender.name, spec, prefix, ranks)
        return {"contender": contender.name, "pid": os.getpid(), "metrics": times, "cpu": None,
                "first_batch": {}, "world_size": ranks[0]["world_size"], "steps": len(ranks[0]["ends"])}  # fmt: skip
    result = metrics(spec, t0, t1, ranks)
    cpu = cpu_breakdown(ranks[0]["snapshots"], {r["pid"] for r in ranks.values()}, result["window_samples"])
    if cpu is not None:
        cpu["coordinating_s_per_gb"] = coordinating_s_per_gb(cpu, row_bytes(ranks[0]["first_batch"]))
    return {
        "contender": contender.name,
        "pid": os.getpid(),
        "metrics": result,
        "cpu": cpu,
        "first_batch": {str(r): x["first_batch"] for r, x in sorted(ranks.items())},
        "world_size": ranks[0]["world_size"],
        "worker_threads": ranks[0]["threads"],
        "steps": len(ranks[0]["ends"]),
        "driver_peak_rss_mb": _peak_rss_mb(),
        "ranks": {str(r): {k: x[k] for k in ("pid", "starts", "ends", "cpu")} for r, x in sorted(ranks.items())},
        "snapshots": ranks[0]["snapshots"],
    }


def main(argv: list[str] | None = None) -> None:
    measurement_main(argv, __doc__, CONTENDERS, DataSpec, measure)  # type: ignore[arg-type]


if __name__ == "__main__":
    # The module under its own name: what goes to the Ray workers (the model, the dataset's functions) is then
    # pickled by reference to benchmarks.data_driver, not by value from __main__ (which fails on torch's globals).
    from benchmarks import data_driver

    data_driver.main()
