"""One storage-benchmark measurement: a fresh driver process runs one case's fit and writes what it saw.

    python -m benchmarks.storage_driver --contender mem_storage --spec spec.json --result result.json

Started by :mod:`benchmarks.storage`, once per case and repeat (the resume case: twice, the first driver
SIGKILLed by the harness). The driver connects to the harness's Ray cluster before any timer starts, then
fits the sharded benchmark's model (:mod:`benchmarks.sharded_workload`) for several epochs with
checkpoints at every epoch end (or none, in the reference cases), into the harness's S3 server where the
case has ``storage_path``. Every rank runs :class:`~benchmarks.storage_probe.CheckpointProbe`, which writes a file
per rank (its peak RSS, how long each epoch-end checkpoint held its training thread); rank 0 runs the benchmarks'
:class:`~benchmarks.workload.StepClock`. Every process is on one machine, so all ``time.time()`` compare.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from benchmarks import read_ranks
from benchmarks.measure import _fit_metrics, _peak_rss_mb, measurement_main
from benchmarks.sharded_measure import MemorySampler
from benchmarks.sharded_workload import Block, ShardedModule, ShardedSpec
from benchmarks.storage_probe import CheckpointProbe
from benchmarks.workload import Spec, StepClock, pl, ray_train_trainer, read_clock, trainer_kwargs

# The folder of the bucket where ray_lightning's runs go, and Ray Train's.
RUNS = "runs"
RAY_TRAIN_RUNS = "ray_train"


@dataclass
class StorageSpec(ShardedSpec):
    """:class:`~benchmarks.sharded_workload.ShardedSpec` plus the sizes of the three parts; ``steps`` and
    ``blocks``: the memory part's (per epoch), ``cost_*``: the checkpoint-cost and resume parts'."""

    steps: int = 2
    epochs: int = 2
    warmup: int = 4
    # The checkpoint-cost and resume parts: fewer blocks (5 x 8.4M parameters + the ends: 42M, 168 MB; with
    # Adam's two moments 505 MB of state), Adam, epochs of `cost_steps` steps.
    cost_blocks: int = 5
    cost_steps: int = 10
    cost_epochs: int = 3
    # Set by the harness for each measurement: the bucket (s3://name), the S3 endpoint, the run's name.
    bucket: str = ""
    endpoint: str = ""
    run_name: str = ""
    # How long the first driver of the resume case holds at its second epoch's start, waiting to be killed.
    hold_s: float = 600.0

    @classmethod
    def tiny(cls) -> StorageSpec:
        """Every code path in seconds of compute."""
        sizes = asdict(ShardedSpec.tiny())
        return cls(**{**sizes, "steps": 2, "warmup": 1, "blocks": 2}, epochs=2, cost_blocks=2, cost_steps=3,
                   cost_epochs=2)  # fmt: skip

    def shape(self, part: str) -> tuple[StorageSpec, int]:
        """The module's sizes (``steps``: per epoch) and the epochs of a fit of ``part``."""
        if part == "memory":
            return self, self.epochs
        return replace(self, blocks=self.cost_blocks, steps=self.cost_steps), self.cost_epochs

    @property
    def storage_url(self) -> str:
        return f"{self.bucket}/{RUNS}"


class AdamModule(ShardedModule):
    """The sharded benchmark's model trained with Adam: two moments per parameter, the state a checkpoint holds."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


@dataclass(frozen=True)
class Case:
    """One way to run the fit: its name on the command line, its label in the tables."""

    name: str
    label: str
    part: str  # "memory", "cost" or "resume"
    sharded: bool = True  # RayFSDPStrategy, else RayStrategy (DDP)
    max_failures: int = 1
    storage: bool = True  # storage_path=s3://<bucket>/runs
    sync: bool = False  # every checkpoint waits for its upload (ray_lightning.home.storage.uploads().wait())
    ray_train: str | None = None  # Ray Train's checkpoint_upload_mode: "SYNC" or "ASYNC"
    against: str | None = None  # the synchronous case of the same strategy (cost part)
    hold: bool = False  # the resume case's first driver: holds at the second epoch until the harness kills it

    @property
    def checkpoints(self) -> bool:
        return self.storage or self.max_failures > 0 or self.ray_train is not None


_FSDP = "RayFSDPStrategy(num_workers=2"
CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case("mem_none", f"{_FSDP}, max_failures=0): no recovery checkpoints (reference)", "memory",
             max_failures=0, storage=False),
        Case("mem_driver", f"{_FSDP}, max_failures=1), no storage_path: each rank's shard to the driver's disk",
             "memory", storage=False),
        Case("mem_storage", f"{_FSDP}, max_failures=1, storage_path=s3://...): each rank uploads its shard",
             "memory"),
        Case("mem_ddp_none", "RayStrategy(num_workers=2, max_failures=0): no recovery checkpoints (reference)",
             "memory", sharded=False, max_failures=0, storage=False),
        Case("mem_ddp_driver", "RayStrategy(num_workers=2, max_failures=1), no storage_path: each rank's part of "
             "the checkpoint to the driver's disk", "memory", sharded=False, storage=False),
        Case("cost_fsdp_none", f"{_FSDP}, max_failures=0): no checkpoints (step reference)", "cost",
             max_failures=0, storage=False),
        Case("cost_fsdp_sync", f"{_FSDP}, max_failures=1, storage_path=s3://...), each save waits for its upload",
             "cost", sync=True),
        Case("cost_fsdp_async", f"{_FSDP}, max_failures=1, storage_path=s3://...): uploads in the background",
             "cost", against="cost_fsdp_sync"),
        Case("cost_ddp_none", "RayStrategy(num_workers=2, max_failures=0): no checkpoints (step reference)", "cost",
             sharded=False, max_failures=0, storage=False),
        Case("cost_ddp_sync", "RayStrategy(num_workers=2, max_failures=1, storage_path=s3://...), each save waits "
             "for its upload", "cost", sharded=False, sync=True),
        Case("cost_ddp_async", "RayStrategy(num_workers=2, max_failures=1, storage_path=s3://...): uploads in the "
             "background", "cost", sharded=False, against="cost_ddp_sync"),
        Case("ray_train_sync", "Ray Train TorchTrainer + RayDDPStrategy, RunConfig(storage_path=S3), "
             "RayTrainReportCallback(checkpoint_upload_mode=SYNC)", "cost", sharded=False, ray_train="SYNC"),
        Case("ray_train_async", "Ray Train TorchTrainer + RayDDPStrategy, RunConfig(storage_path=S3), "
             "RayTrainReportCallback(checkpoint_upload_mode=ASYNC)", "cost", sharded=False, ray_train="ASYNC",
             against="ray_train_sync"),
        Case("cold_start", f"{_FSDP}, max_failures=1, storage_path=s3://..., run_name=<new>): no checkpoint yet",
             "resume"),
        Case("resume", f"{_FSDP}, max_failures=1, storage_path=s3://..., run_name=<the killed driver's>): the "
             "same script again after its driver was SIGKILLed", "resume"),
    )
}  # fmt: skip
# The resume case's first driver, run by the harness before each `resume` measurement (not a case of its own).
FIRST_DRIVER = Case("resume_first", "the resume case's first driver (SIGKILLed)", "resume", hold=True)
DRIVER_CASES = {**CASES, FIRST_DRIVER.name: FIRST_DRIVER}


def _trainer_arguments(sizes: Spec, epochs: int) -> dict[str, Any]:
    return {**trainer_kwargs(sizes, sizes.steps), "max_epochs": epochs}


def _module(sizes: StorageSpec, part: str) -> ShardedModule:
    return ShardedModule(sizes) if part == "memory" else AdamModule(sizes)


def _callbacks(spec: StorageSpec, case: Case, prefix: str) -> list[pl.Callback]:
    probe = CheckpointProbe(prefix, case.sync, uploads=case.storage and case.ray_train is None,
                            hold_s=spec.hold_s if case.hold else None,
                            exact_memory=case.part == "memory")  # fmt: skip
    return [StepClock(prefix + ".clock"), probe]


def _ray_lightning_fit(spec: StorageSpec, case: Case, prefix: str, sizes: StorageSpec, epochs: int) -> dict[str, Any]:
    from ray_lightning import RayFSDPStrategy, RayStrategy

    options: dict[str, Any] = {"num_workers": spec.workers, "max_failures": case.max_failures}
    if case.storage:
        options.update(storage_path=spec.storage_url, run_name=spec.run_name)
    if case.sharded:
        # As the sharded benchmark's ray_fsdp contender: each block one FSDP unit, the weights home after fit.
        strategy = RayFSDPStrategy(auto_wrap_policy={Block}, full_weights_home=True, **options)
    else:
        strategy = RayStrategy(**options)
    trainer = pl.Trainer(**_trainer_arguments(sizes, epochs), strategy=strategy,
                         callbacks=_callbacks(spec, case, prefix))  # fmt: skip
    module = _module(sizes, case.part)
    with MemorySampler() as sampler:
        t0 = time.time()
        trainer.fit(module)
        t1 = time.time()
    return {
        "t0": t0,
        "t1": t1,
        "driver_peak_rss_mb": _peak_rss_mb(),
        "driver_peak_shmem_mb": sampler.peak.get("RssShmem"),
        "model_mb": sum(t.numel() * t.element_size() for t in module.state_dict().values()) / 2**20,
        "params": sum(p.numel() for p in module.parameters()),
        "driver_global_step": trainer.global_step,
        "restarts": len(trainer.strategy.restarts),
    }


def ray_train_filesystem(endpoint: str) -> Any:
    """pyarrow's S3 filesystem on the harness's server (Ray Train's storage goes through pyarrow, not fsspec)."""
    from pyarrow import fs

    scheme, _, host = endpoint.partition("://")
    return fs.S3FileSystem(access_key=os.environ["AWS_ACCESS_KEY_ID"], secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                           region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"), endpoint_override=host,
                           scheme=scheme)  # fmt: skip


def _ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: Ray Train's Lightning recipe, a checkpoint reported at every epoch end."""
    from ray.train import CheckpointUploadMode
    from ray.train.lightning import RayTrainReportCallback

    spec, case = StorageSpec.from_json(config["spec"]), DRIVER_CASES[config["case"]]
    sizes, epochs = spec.shape(case.part)
    report = RayTrainReportCallback(checkpoint_upload_mode=CheckpointUploadMode[case.ray_train or "SYNC"])
    trainer = ray_train_trainer(_trainer_arguments(sizes, epochs), [*_callbacks(spec, case, config["prefix"]), report])
    trainer.fit(_module(sizes, case.part))


def _ray_train_fit(spec: StorageSpec, case: Case, prefix: str, sizes: StorageSpec, epochs: int) -> dict[str, Any]:
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"spec": spec.to_json(), "case": case.name, "prefix": prefix},
        scaling_config=ScalingConfig(num_workers=spec.workers, use_gpu=False),
        run_config=RunConfig(
            # pyarrow wants the bucket and path without the scheme when it is given the filesystem.
            storage_path=f"{spec.bucket.removeprefix('s3://')}/{RAY_TRAIN_RUNS}",
            storage_filesystem=ray_train_filesystem(spec.endpoint),
            name=spec.run_name,
            # As ray_lightning keeps only its newest recovery checkpoint.
            checkpoint_config=CheckpointConfig(num_to_keep=1),
        ),
    )
    module = _module(sizes, case.part)
    t0 = time.time()
    result = trainer.fit()
    t1 = time.time()
    return {
        "t0": t0,
        "t1": t1,
        "driver_peak_rss_mb": _peak_rss_mb(),
        "driver_peak_shmem_mb": None,
        "model_mb": sum(t.numel() * t.element_size() for t in module.state_dict().values()) / 2**20,
        "params": sum(p.numel() for p in module.parameters()),
        "driver_global_step": None,
        "restarts": 0,
        "checkpoint_reported": result.checkpoint is not None,
    }


def _blocked(ranks: dict[int, dict[str, Any]]) -> list[float]:
    """Per epoch-end checkpoint, the longest any rank's training thread was held (the others wait for it at the
    next collective)."""
    by_step: dict[int, float] = {}
    for record in ranks.values():
        for c in record["checkpoints"]:
            by_step[c["global_step"]] = max(by_step.get(c["global_step"], 0.0), c["blocked_s"])
    return [by_step[s] for s in sorted(by_step)]


def _cost_metrics(
    spec: StorageSpec, case: Case, clock: dict[str, Any], ranks: dict[int, dict], extra: dict[str, Any]
) -> dict[str, Any]:
    """The step (median and mean over every epoch after the first, epoch ends included) and each checkpoint's
    blocked time, alone and as a share of an epoch of steps (checkpoints at epoch ends)."""
    sizes, epochs = spec.shape(case.part)
    ends = clock["batch_ends"]
    per_epoch = sizes.steps
    if len(ends) != per_epoch * epochs:
        raise RuntimeError(f"rank 0 ran {len(ends)} steps, not {per_epoch * epochs}")
    base = _fit_metrics(sizes, clock["t0"], clock["t1"], clock)
    first, last = per_epoch - 1, per_epoch * epochs - 1
    blocked = _blocked(ranks)
    if case.checkpoints and len(blocked) != epochs:
        raise RuntimeError(f"{len(blocked)} epoch-end checkpoints timed, not {epochs} (wrapped: "
                           f"{ {r: x['wrapped'] for r, x in ranks.items()} })")  # fmt: skip
    # The steady state: the first checkpoint also makes what later ones reuse (the uploads' process group, the
    # S3 client), reported apart.
    steady = blocked[1:] or blocked
    per_checkpoint = statistics.median(steady) if steady else None
    waited = [r["uploads_blocked_s"] for r in ranks.values() if r["uploads_blocked_s"] is not None]
    return {
        # What a checkpoint holds: the weights and Adam's two moments (float32).
        "state_mb": 3 * extra["model_mb"],
        "step_ms": base["step_s"] * 1000,
        "mean_step_ms": (ends[last] - ends[first]) / (last - first) * 1000,
        "blocked_s": per_checkpoint,
        "first_blocked_s": blocked[0] if blocked else None,
        # A checkpoint at every epoch end: its blocked time against the epoch's steps.
        "blocked_share_pct": None if per_checkpoint is None else per_checkpoint / (per_epoch * base["step_s"]) * 100,
        # Where the ranks upload in the background: the longest any rank waited for its previous upload, per checkpoint.
        "upload_wait_s": max(waited) / len(blocked) if waited and blocked and not case.sync else None,
        "checkpoints": len(blocked),
        "fit_s": base["wall_s"],
    }


def _memory_metrics(extra: dict[str, Any], ranks: dict[int, dict]) -> dict[str, Any]:
    rank0, rank1 = (ranks[r]["peak_rss_mb"] if r in ranks else None for r in (0, 1))
    return {
        "driver_peak_rss_mb": extra["driver_peak_rss_mb"],
        "driver_peak_shmem_mb": extra["driver_peak_shmem_mb"],
        "rank0_peak_rss_mb": rank0,
        "rank1_peak_rss_mb": rank1,
        "rank0_over_rank1": rank0 / rank1 if rank0 and rank1 else None,
        "model_mb": extra["model_mb"],
        "fit_s": extra["t1"] - extra["t0"],
    }


def _resume_metrics(extra: dict[str, Any], clock: dict[str, Any], ranks: dict[int, dict]) -> dict[str, Any]:
    return {
        "fit_first_step_s": clock["first_optimizer_step"] - extra["t0"],
        # Where that goes: fit() called → rank 0's on_fit_start (workers up), → its first batch (the checkpoint
        # restored: Lightning restores the optimizers and loops after on_fit_start).
        "launch_s": clock["fit_start"] - extra["t0"],
        "setup_s": clock["first_batch_start"] - clock["fit_start"],
        "fit_s": extra["t1"] - extra["t0"],
        "resumed_step": ranks[0]["start_step"] if 0 in ranks else None,
        # Absolute times: the harness subtracts the driver process's start (and the kill) from them.
        "first_step_at": clock["first_optimizer_step"],
        "fit_return_at": extra["t1"],
    }


def measure(case: Case, spec: StorageSpec, result_path: str, record: bool = True) -> dict[str, Any]:
    """Connect to the harness's cluster, run the case's fit, return its metrics (``record``: unused here)."""
    import ray

    ray.init(address=spec.ray_address, log_to_driver=True)
    prefix = result_path
    sizes, epochs = spec.shape(case.part)
    fit = _ray_train_fit if case.ray_train else _ray_lightning_fit
    extra = fit(spec, case, prefix, sizes, epochs)
    clock = {**read_clock(prefix + ".clock"), "t0": extra["t0"], "t1": extra["t1"]}
    ranks = read_ranks(prefix)
    if set(ranks) != set(range(spec.workers)):
        raise RuntimeError(f"probe files from ranks {sorted(ranks)}, not from all {spec.workers}")
    if case.part == "memory":
        metrics = _memory_metrics(extra, ranks)
    elif case.part == "cost":
        metrics = _cost_metrics(spec, case, clock, ranks, extra)
    else:
        metrics = _resume_metrics(extra, clock, ranks)
    metrics["final_global_step"] = ranks[0]["final_step"]
    state = {k: v for k, v in extra.items() if k not in ("t0", "t1")}
    return {
        "contender": case.name,
        "pid": os.getpid(),
        "metrics": metrics,
        "driver": state,
        "ranks": {str(r): x for r, x in sorted(ranks.items())},
        "clock_first_step": clock["first_optimizer_step"],
    }


def main(argv: list[str] | None = None) -> None:
    measurement_main(argv, __doc__, DRIVER_CASES, StorageSpec, measure)


if __name__ == "__main__":
    main()
