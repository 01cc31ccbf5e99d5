"""The contenders: one way each to run ``fit`` of the same module on ``spec.workers`` processes.

Each ``fit`` function trains ``module`` for ``steps`` optimizer steps with a :class:`StepClock`
writing rank 0's times to ``clock_path``, and returns when the driver's ``module`` holds the
trained weights (where the contender brings them back at all).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.workload import BenchModule, Spec, StepClock, WeightsModule, pl, ray_train_trainer, trainer_kwargs

FitFn = Callable[[Spec, BenchModule, str, int], Any]


@dataclass(frozen=True)
class Contender:
    """One way to train: its name on the command line, its label in the table, its ``fit``."""

    name: str
    label: str
    fit: FitFn
    uses_ray: bool
    # Rank 0 is the driver process itself (Lightning's `ddp`): no weights travel back.
    driver_is_rank_zero: bool = False
    note: str = ""


def _lightning_fit(strategy: Callable[[Spec], dict[str, Any]]) -> FitFn:
    """A contender that is one ``pl.Trainer(**strategy(spec)).fit(module)`` in the driver."""

    def fit(spec: Spec, module: BenchModule, clock_path: str, steps: int) -> pl.Trainer:
        trainer = pl.Trainer(**trainer_kwargs(spec, steps), **strategy(spec), callbacks=[StepClock(clock_path)])
        trainer.fit(module)
        return trainer

    return fit


def _ray_strategy(spec: Spec) -> dict[str, Any]:
    from ray_lightning import RayStrategy

    return {"strategy": RayStrategy(num_workers=spec.workers)}


def _ray_strategy_without_watchdog(spec: Spec) -> dict[str, Any]:
    from ray_lightning import RayStrategy

    # progress_timeout_s=None: no loop bound (the ranks still report their startup phases).
    return {"strategy": RayStrategy(num_workers=spec.workers, progress_timeout_s=None)}


def _ray_strategy_on_gpus(spec: Spec) -> dict[str, Any]:
    from ray_lightning import RayStrategy

    return {"strategy": RayStrategy(num_workers=spec.workers, use_gpu=True)}


def _lightning_on_gpus(spec: Spec) -> dict[str, Any]:
    # Lightning's own choice for this many CUDA devices: its single-device strategy for one.
    return {"accelerator": "cuda", "devices": spec.workers}


def _horovod_ray_strategy(spec: Spec) -> dict[str, Any]:
    from ray_lightning import HorovodRayStrategy

    return {"strategy": HorovodRayStrategy(num_workers=spec.workers)}


def _lightning_strategy(name: str) -> Callable[[Spec], dict[str, Any]]:
    def strategy(spec: Spec) -> dict[str, Any]:
        return {"strategy": name, "accelerator": "cpu", "devices": spec.workers}

    return strategy


# -- Ray Train ------------------------------------------------------------------------------------

_CHECKPOINT_FILE = "model.pt"


def _ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: the user's script rewritten around a function."""
    import ray.train
    from ray.train import Checkpoint

    spec = Spec.from_json(config["spec"])
    module = (WeightsModule if config["weights"] else BenchModule)(spec)
    trainer = ray_train_trainer(trainer_kwargs(spec, config["steps"]), [StepClock(config["clock"])])
    trainer.fit(module)
    if not config["weights"]:
        return
    # Nothing comes back to the caller by itself: rank 0 reports the weights as a checkpoint, which
    # Ray Train persists to storage_path; every rank must call report (it is a barrier).
    metrics = {"global_step": trainer.global_step}
    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="rlb-ckpt-") as directory:
        torch.save(module.state_dict(), os.path.join(directory, _CHECKPOINT_FILE))
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))


def _ray_train_fit(spec: Spec, module: BenchModule, clock_path: str, steps: int) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    weights = isinstance(module, WeightsModule)
    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"spec": spec.to_json(), "steps": steps, "clock": clock_path, "weights": weights},
        scaling_config=ScalingConfig(num_workers=spec.workers, use_gpu=False),
        run_config=RunConfig(storage_path=os.path.join(spec.scratch, "ray_train"), name=f"fit-{uuid.uuid4().hex[:8]}"),
    )
    result = trainer.fit()
    if weights:
        if result.checkpoint is None:
            raise RuntimeError("Ray Train returned no checkpoint although rank 0 reported one")
        with result.checkpoint.as_directory() as directory:
            state = torch.load(os.path.join(directory, _CHECKPOINT_FILE), map_location="cpu")
        module.load_state_dict(state)


CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in (
        Contender("ray", "ray_lightning RayStrategy", _lightning_fit(_ray_strategy), uses_ray=True),
        Contender(
            "ray_no_watchdog",
            "ray_lightning RayStrategy, progress_timeout_s=None",
            _lightning_fit(_ray_strategy_without_watchdog),
            uses_ray=True,
            note="the progress watchdog's loop bound off: what the watchdog costs a step",
        ),
        Contender("horovod_ray", "ray_lightning HorovodRayStrategy", _lightning_fit(_horovod_ray_strategy), True),
        Contender("ddp_spawn", "Lightning ddp_spawn (gloo)", _lightning_fit(_lightning_strategy("ddp_spawn")), False),
        Contender(
            "ddp",
            "Lightning ddp (gloo)",
            _lightning_fit(_lightning_strategy("ddp")),
            uses_ray=False,
            driver_is_rank_zero=True,
            note="rank 0 is the driver process: the weights never leave it",
        ),
        Contender(
            "ray_train",
            "Ray Train TorchTrainer + RayDDPStrategy",
            _ray_train_fit,
            uses_ray=True,
            note="nothing comes back to the driver by itself; in the weights-back fit rank 0 reports a checkpoint "
            "and the driver loads result.checkpoint into its module, and that whole path is timed",
        ),
    )
}
BASELINE = "ddp_spawn"
# One GPU per worker (benchmarks/step.py --device gpu), apart: every other benchmark runs without a GPU.
GPU_CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in (
        Contender("ray_gpu", "ray_lightning RayStrategy, use_gpu=True", _lightning_fit(_ray_strategy_on_gpus), True),
        Contender(
            "lightning_gpu",
            "Lightning's own Trainer, accelerator='cuda'",
            _lightning_fit(_lightning_on_gpus),
            uses_ray=False,
            driver_is_rank_zero=True,
            note="devices=workers: for one GPU, Lightning's single-device strategy in the driver process (no launcher)",
        ),
    )
}
GPU_BASELINE = "lightning_gpu"
