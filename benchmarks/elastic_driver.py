"""One spot-pattern measurement: a fresh driver process trains the fixed number of samples with one contender.

    python -m benchmarks.elastic_driver --contender elastic --spec spec.json --result result.json

Started by :mod:`benchmarks.elastic`, once per contender and repeat, on a multi-node Ray cluster that the harness
owns (it removes and adds the nodes; this process only trains). The driver connects before any timer starts, then
fits :class:`ElasticModule` for ``spec.epochs`` epochs of ``spec.train_size`` samples, ``spec.global_batch`` samples
per optimizer step whatever the number of workers, and evaluates the trained weights on the held-out set itself
(the same code for every contender).

Every rank's :class:`SpotProgress` writes files the harness reads: which node each rank of each attempt is on, and
rank 0's progress after every batch (the fraction of the samples trained, which triggers the spot pattern).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from benchmarks.measure import measurement_main
from benchmarks.tune_workload import TuneModule, _dataset, append_record, read_records
from benchmarks.workload import Spec, pl, ray_train_trainer


@dataclass
class ElasticSpec(Spec):
    """The run's sizes. ``workers`` is the most workers (one per worker node), ``batch_size`` the per-worker batch at
    that size; the global batch, ``workers * batch_size``, is the same for every contender at every size."""

    workers: int = 3
    min_workers: int = 2
    batch_size: int = 32
    features: int = 32
    hidden: int = 128
    classes: int = 8
    lr: float = 0.05
    # 30% and 60% of the samples fall inside epochs 4 and 8 (of 12), not at their ends.
    epochs: int = 12
    train_size: int = 19_200  # 200 optimizer steps of 96 samples per epoch
    val_size: int = 4096
    # Each worker sleeps this long per sample of its batch in every training step: a node's own compute. The worker
    # nodes of this benchmark are processes sharing the machine's cores, so the MLP alone would train about as fast
    # on 2 workers as on 3; the sleep makes a worker's throughput its node's, as on real machines (see elastic.py).
    sample_ms: float = 0.25
    # The spot pattern, as fractions of the samples trained (rank 0's progress): a worker node is removed at
    # `lose_at`, and a node like it comes back at `back_at` (progress-triggered contenders) or `absence_s` after
    # the loss (the fixed-size contender, which makes no progress while the node is away; see elastic.py).
    lose_at: float = 0.3
    back_at: float = 0.6
    absence_s: float = 30.0  # the fixed-size contender's absence when no elastic run of its round measured one
    # Ray Train's ScalingConfig(elastic_resize_monitor_interval_s): how often its controller looks for more workers.
    resize_monitor_s: float = 1.0
    max_failures: int = 3
    # RayStrategy's wait for the placement of its workers (generous: a busy 2-core machine starts them slowly).
    placement_timeout_s: float = 600.0

    @classmethod
    def tiny(cls) -> ElasticSpec:
        """Every code path (a loss, a return, a grow) in seconds of compute."""
        return cls(hidden=32, epochs=4, train_size=96 * 16, val_size=256, sample_ms=0.0, absence_s=5.0, smoke=True)

    @property
    def global_batch(self) -> int:
        return self.workers * self.batch_size

    @property
    def cluster_cpus(self) -> int:
        return self.workers

    @property
    def checkpoint_every(self) -> int:
        """The elastic contender's ``recovery_checkpoint_every_n_steps``: a tenth of an epoch (at least 4 steps), so
        that it grows within that many steps of the node's return instead of at the epoch's end."""
        return max(4, self.train_size // self.global_batch // 10)


class ElasticModule(TuneModule):
    """The Tune benchmark's MLP on its teacher-labelled data (:mod:`benchmarks.tune_workload`), with a fixed learning
    rate, no validation inside ``fit``, a per-worker batch of ``batch_size``, and a step that also sleeps
    ``spec.sample_ms`` per sample of the batch (the worker node's own compute)."""

    def __init__(self, spec: ElasticSpec, batch_size: int | None = None) -> None:
        super().__init__(spec, spec.lr)
        self.batch_size = batch_size or spec.batch_size

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.spec.sample_ms:
            time.sleep(self.spec.sample_ms * len(batch[0]) / 1000)
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        data = _dataset(self.spec, self.spec.train_size, self.spec.seed + 1)
        return DataLoader(data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_dataset(self.spec, self.spec.val_size, self.spec.seed + 2), batch_size=1024)


def accuracy(module: ElasticModule, spec: ElasticSpec) -> float:
    """The trained module's accuracy on the held-out set, computed here in the driver (every contender alike)."""
    data = _dataset(spec, spec.val_size, spec.seed + 2)
    module.eval()
    with torch.no_grad():
        return (module(data.tensors[0]).argmax(dim=1) == data.tensors[1]).float().mean().item()


def trainer_kwargs(spec: ElasticSpec) -> dict[str, Any]:
    """The Trainer arguments of every contender: ``spec.epochs`` whole epochs, nothing but training."""
    return dict(
        max_epochs=spec.epochs,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


@dataclass(frozen=True)
class SpotPaths:
    """The files of one measurement: every rank's node per attempt, rank 0's progress, the harness's events."""

    ranks: str
    progress: str
    events: str

    @classmethod
    def under(cls, result_path: str) -> SpotPaths:
        return cls(result_path + ".ranks", result_path + ".progress", result_path + ".events")


def _node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


class SpotProgress(pl.Callback):
    """Every rank records its node when an attempt starts training; rank 0 appends its progress after every batch:
    ``{"pid", "fraction", "global_step", "world_size", "t"}``, ``fraction`` being the share of the fit's samples
    trained (epochs done plus this epoch's share), whatever the batch sizes."""

    def __init__(self, paths: SpotPaths) -> None:
        self.paths = paths
        self._progress: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {"rank": trainer.global_rank, "world_size": trainer.world_size, "node_id": _node_id(),
                  "pid": os.getpid(), "t": time.time(), "global_step": trainer.global_step,
                  "epoch": trainer.current_epoch, "batch_size": getattr(pl_module, "batch_size", None),
                  "accumulate_grad_batches": trainer.accumulate_grad_batches}  # fmt: skip
        append_record(self.paths.ranks, record)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank != 0:
            return
        if self._progress is None:
            self._progress = open(self.paths.progress, "a")  # one open per attempt, closed with it
        batches = trainer.num_training_batches
        fraction = (trainer.current_epoch + (batch_idx + 1) / batches) / trainer.max_epochs
        record = {"pid": os.getpid(), "fraction": fraction, "global_step": trainer.global_step,
                  "world_size": trainer.world_size, "t": time.time(), "batch": len(batch[0])}  # fmt: skip
        self._progress.write(json.dumps(record) + "\n")
        self._progress.flush()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._progress is not None:
            self._progress.close()
            self._progress = None


@dataclass(frozen=True)
class Contender:
    """One way to train the samples on the spot cluster: its name, its label, its fit, how the node comes back."""

    name: str
    label: str
    # Runs the fit; returns the trained module (its weights in the driver) and what the contender reports itself.
    fit: Callable[[ElasticSpec, SpotPaths], tuple[ElasticModule, dict[str, Any]]]
    # The spot pattern: "progress" (lost at lose_at, back at back_at of the samples), "time" (lost at lose_at, back
    # a wall time after the loss: the fixed size makes no progress without the node) or None (no failure).
    pattern: str | None = "progress"


def _restart_records(trainer: pl.Trainer) -> list[dict[str, Any]]:
    # trainer.strategy: a lightning.pytorch Trainer runs a copy of the strategy given (rebuilt for its namespace).
    return [{**asdict(r), "cause": r.cause[:200]} for r in getattr(trainer.strategy, "restarts", [])]


def _ray_lightning(**strategy_kwargs: Any) -> Callable[[ElasticSpec, SpotPaths], tuple[ElasticModule, dict]]:
    def fit(spec: ElasticSpec, paths: SpotPaths) -> tuple[ElasticModule, dict[str, Any]]:
        from ray_lightning import RayStrategy

        kwargs = {key: value(spec) if callable(value) else value for key, value in strategy_kwargs.items()}
        module = ElasticModule(spec)
        trainer = pl.Trainer(**trainer_kwargs(spec), strategy=RayStrategy(**kwargs), callbacks=[SpotProgress(paths)])
        trainer.fit(module)
        return module, {"restarts": _restart_records(trainer), "driver_global_step": trainer.global_step}

    return fit


def _cluster_holds(workers: int) -> bool:
    import ray

    return ray.cluster_resources().get("CPU", 0.0) >= workers  # the head has no CPU: only worker nodes count


def _fixed_size(spec: ElasticSpec, paths: SpotPaths) -> tuple[ElasticModule, dict[str, Any]]:
    """``RayStrategy(num_workers=3, max_failures=3)``, and what a job scheduler does when such a fit fails because
    the cluster can no longer hold its workers: wait until it can, then fit again from the newest epoch-end
    checkpoint (``ModelCheckpoint`` in the driver's directory; every node is on this machine).

    RayStrategy itself waits up to 30 s for Ray to place the lost node's workers again (keeping the survivors'
    processes and state): a node back within that rides it out without a resubmission; after that its restart's
    placement fails with ``ClusterResourceError`` on a cluster without an autoscaler."""
    from ray_lightning import RayStrategy
    from ray_lightning.errors import ClusterResourceError

    directory = os.path.join(spec.scratch, "fixed-checkpoints")
    resubmissions: list[dict[str, Any]] = []
    restarts: list[dict[str, Any]] = []
    ckpt_path = None
    while True:
        module = ElasticModule(spec)
        strategy = RayStrategy(num_workers=spec.workers, max_failures=spec.max_failures,
                               placement_timeout_s=spec.placement_timeout_s)  # fmt: skip
        checkpoints = pl.callbacks.ModelCheckpoint(dirpath=directory, save_top_k=1)  # the newest epoch end
        trainer = pl.Trainer(**{**trainer_kwargs(spec), "enable_checkpointing": True}, strategy=strategy,
                             callbacks=[SpotProgress(paths), checkpoints])  # fmt: skip
        try:
            trainer.fit(module, ckpt_path=ckpt_path)
            restarts += _restart_records(trainer)
            break
        except ClusterResourceError as error:
            restarts += _restart_records(trainer)
            if len(resubmissions) >= spec.max_failures:
                raise
            failed = time.time()
            while not _cluster_holds(spec.workers):
                time.sleep(0.2)
            saved = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
            ckpt_path = os.path.join(directory, saved[-1]) if saved else None
            resubmissions.append({"failed_at": failed, "resubmitted_at": time.time(), "ckpt_path": ckpt_path,
                                  "error": str(error)[:300]})  # fmt: skip
    restarts += [{"reason": "resubmitted", **r} for r in resubmissions]
    return module, {"restarts": restarts, "resubmissions": resubmissions, "driver_global_step": trainer.global_step}


def _ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: Ray Train's documented Lightning integration, resuming from
    ``ray.train.get_checkpoint()``; the per-worker batch keeps the global batch at every world size (by hand: Ray
    Train leaves the batch to the loop)."""
    import ray.train
    from ray.train.lightning import RayTrainReportCallback

    spec, paths = ElasticSpec.from_json(config["spec"]), SpotPaths(**config["paths"])
    world_size = ray.train.get_context().get_world_size()
    module = ElasticModule(spec, batch_size=spec.global_batch // world_size)
    # RayTrainReportCallback: a checkpoint reported at every epoch end.
    trainer = ray_train_trainer(trainer_kwargs(spec), [SpotProgress(paths), RayTrainReportCallback()])
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        trainer.fit(module)
        return
    with checkpoint.as_directory() as directory:
        trainer.fit(module, ckpt_path=os.path.join(directory, RayTrainReportCallback.CHECKPOINT_NAME))


def _ray_train(spec: ElasticSpec, paths: SpotPaths) -> tuple[ElasticModule, dict[str, Any]]:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.lightning import RayTrainReportCallback
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"spec": spec.to_json(), "paths": asdict(paths)},
        scaling_config=ScalingConfig(
            num_workers=(spec.min_workers, spec.workers),
            use_gpu=False,
            elastic_resize_monitor_interval_s=spec.resize_monitor_s,
        ),
        run_config=RunConfig(
            storage_path=os.path.join(spec.scratch, "ray_train"),
            name=f"elastic-{uuid.uuid4().hex[:8]}",
            failure_config=FailureConfig(max_failures=spec.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()
    # The trained weights: the last epoch's reported checkpoint, loaded into a module here.
    module = ElasticModule(spec)
    with result.checkpoint.as_directory() as directory:
        state = torch.load(os.path.join(directory, RayTrainReportCallback.CHECKPOINT_NAME), weights_only=False)
    module.load_state_dict(state["state_dict"])
    return module, {"checkpoint": result.checkpoint.path, "error": str(result.error) if result.error else None}


CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in (
        Contender(
            "elastic",
            "ray_lightning RayStrategy(num_workers=(2, 3), batch_policy='keep_global_batch', "
            "recovery_checkpoint_every_n_steps=a tenth of an epoch)",
            _ray_lightning(
                num_workers=lambda s: (s.min_workers, s.workers),
                max_failures=lambda s: s.max_failures,
                batch_policy="keep_global_batch",
                grow_check_interval_s=0.0,
                recovery_checkpoint_every_n_steps=lambda s: s.checkpoint_every,
            ),
        ),
        Contender(
            "fixed",
            "ray_lightning RayStrategy(num_workers=3): waits 30 s for the node, else resubmitted when it is back",
            _fixed_size,
            pattern="time",
        ),
        Contender(
            "ray_train",
            "Ray Train v2 TorchTrainer, ScalingConfig(num_workers=(2, 3)), RayDDPStrategy",
            _ray_train,
        ),
        Contender(
            "uninterrupted",
            "ray_lightning RayStrategy(num_workers=3), no node lost (reference)",
            _ray_lightning(num_workers=lambda s: s.workers),
            pattern=None,
        ),
    )
}


def attempts(paths: SpotPaths) -> list[dict[str, Any]]:
    """Each attempt's rank 0 (in order): when and where it started training, its world size, its batch, and the
    span of the samples it trained (from its progress records)."""
    starts = [r for r in read_records(paths.ranks) if r["rank"] == 0]
    progress = read_records(paths.progress)
    out = []
    for index, start in enumerate(starts):
        # A reused worker process trains the next attempt too: an attempt's records are its process's until the next.
        end = starts[index + 1]["t"] if index + 1 < len(starts) else float("inf")
        mine = [p for p in progress if p["pid"] == start["pid"] and start["t"] <= p["t"] < end]
        out.append({**start, "first_batch_end": mine[0]["t"] if mine else None,
                    "first_fraction": mine[0]["fraction"] if mine else None,
                    "last_fraction": mine[-1]["fraction"] if mine else None,
                    "batches": len(mine), "per_worker_batch": mine[-1]["batch"] if mine else None,
                    "samples": sum(p["batch"] * p["world_size"] for p in mine)})  # fmt: skip
    return out


# Tiny sizes only (they measure nothing): Ray Train gives up a worker group whose placement group is not ready
# sooner than its 60 s default. After the loss its controller tries the old size again until its view of the cluster
# (refreshed every 20 s by Ray's autoscaling coordinator) drops the lost node, waiting this long per try, before it
# starts on fewer workers; on this cluster a placement that can succeed is ready in well under a second. The real
# run keeps Ray Train's default.
SMOKE_RAY_TRAIN_ENVIRONMENT = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "3"}


def measure(contender: Contender, spec: ElasticSpec, result_path: str, record: bool = True) -> dict[str, Any]:
    """Connect to the harness's cluster, train the samples, evaluate; the harness adds the spot pattern's events."""
    import ray

    if spec.smoke:
        os.environ.update(SMOKE_RAY_TRAIN_ENVIRONMENT)
    ray.init(address=spec.ray_address, log_to_driver=True)
    paths = SpotPaths.under(result_path)
    t0 = time.time()
    module, extra = contender.fit(spec, paths)
    t1 = time.time()
    acc = accuracy(module, spec)
    return {"contender": contender.name, "pid": os.getpid(), "t0": t0, "t1": t1, "fit_s": t1 - t0, "acc": acc,
            "attempts": attempts(paths), **extra}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    measurement_main(argv, __doc__, CONTENDERS, ElasticSpec, measure)


if __name__ == "__main__":
    main()
