"""The data benchmark's restarts: how long a RayDataModule fit takes to train again after losing a worker, and
after a resume from a checkpoint in a new fit, at 10% and at 90% of its one epoch.

* ``restart_at_10`` / ``restart_at_90``: ``RayStrategy(max_failures=1, recovery_checkpoint_every_n_steps=1)``;
  rank 1 SIGKILLs itself at the start of that step. Measured: the kill → the restarted rank 0's first batch, and
  its two parts (the kill → ``on_fit_start`` of the new attempt: the workers' restart; → its first batch: the
  data). The coordinator keeps the windows since the last checkpoint, so the resumed epoch is read from the object
  store wherever it failed.
* ``resume_at_10`` / ``resume_at_90``: a fit of that many steps with a checkpoint at its end, then a new fit
  with ``ckpt_path``: a new coordinator, so the pipeline runs again up to the checkpoint's position (in Ray Data's
  tasks; the trained blocks are dropped unread). Measured: the new fit's ``on_fit_start`` → first batch.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from benchmarks.workload import pl

FRACTIONS = {"restart_at_10": 0.1, "restart_at_90": 0.9, "resume_at_10": 0.1, "resume_at_90": 0.9}
LABELS = {
    "restart_at_10": "RayDataModule, a worker killed at 10% of the epoch (max_failures=1)",
    "restart_at_90": "RayDataModule, a worker killed at 90% of the epoch (max_failures=1)",
    "resume_at_10": "RayDataModule, a new fit resumed from a checkpoint at 10% of the epoch",
    "resume_at_90": "RayDataModule, a new fit resumed from a checkpoint at 90% of the epoch",
}


class KillAt(pl.Callback):
    """Rank 1 writes the time to ``<prefix>.killed`` and SIGKILLs itself at the start of step ``step`` (once)."""

    def __init__(self, prefix: str, step: int) -> None:
        self.prefix, self.step = prefix, step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        marker = self.prefix + ".killed"
        if trainer.global_rank == 1 and trainer.global_step == self.step and not os.path.exists(marker):
            Path(marker + ".partial").write_text(str(time.time()))
            os.replace(marker + ".partial", marker)
            os.kill(os.getpid(), signal.SIGKILL)


def kill_step(spec: Any, name: str) -> int:
    return max(1, round(spec.steps * FRACTIONS[name]))


def restart_fit(name: str):
    def fit(spec: Any, prefix: str) -> None:
        from benchmarks.data_driver import DataClock, TinyConvNet, _trainer_arguments
        from benchmarks.data_rows import image_dataset
        from ray_lightning import RayStrategy
        from ray_lightning.data import RayDataModule

        strategy = RayStrategy(num_workers=spec.workers, max_failures=1, recovery_checkpoint_every_n_steps=1)
        clock = DataClock(prefix, 1, spec.steps)
        trainer = pl.Trainer(**_trainer_arguments(spec), strategy=strategy,
                             callbacks=[clock, KillAt(prefix, kill_step(spec, name))])  # fmt: skip
        trainer.fit(TinyConvNet(spec), datamodule=RayDataModule(train=image_dataset(spec), batch_size=spec.batch_size))

    return fit


def resume_fit(name: str):
    def fit(spec: Any, prefix: str) -> None:
        from benchmarks.data_driver import DataClock, TinyConvNet, _trainer_arguments
        from benchmarks.data_rows import image_dataset
        from ray_lightning import RayStrategy
        from ray_lightning.data import RayDataModule

        step = kill_step(spec, name)
        every = pl.callbacks.ModelCheckpoint(dirpath=prefix + ".ckpt", every_n_train_steps=step, save_top_k=-1)
        first = {**_trainer_arguments(spec), "enable_checkpointing": True, "max_steps": step}
        data = RayDataModule(train=image_dataset(spec), batch_size=spec.batch_size)
        pl.Trainer(**first, strategy=RayStrategy(num_workers=spec.workers), callbacks=[every]).fit(
            TinyConvNet(spec), datamodule=data
        )
        clock = DataClock(prefix, 1, spec.steps)
        data = RayDataModule(train=image_dataset(spec), batch_size=spec.batch_size)
        trainer = pl.Trainer(**_trainer_arguments(spec), strategy=RayStrategy(num_workers=spec.workers),
                             callbacks=[clock])  # fmt: skip
        trainer.fit(TinyConvNet(spec), datamodule=data, ckpt_path=every.last_model_path or every.best_model_path)

    return fit


def metrics(name: str, spec: Any, prefix: str, ranks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """A restart's or resume's times, from the final attempt's rank 0 clock (and the kill's time)."""
    rank0 = ranks[0]
    if not rank0["starts"]:
        raise RuntimeError(f"{name}: rank 0 trained no batch after the {name.split('_')[0]}")
    found = {"kill_step": kill_step(spec, name), "steps_after": len(rank0["starts"])}
    found["data_s"] = rank0["starts"][0] - rank0["fit_start"]  # on_fit_start → first batch
    if name.startswith("restart"):
        killed = float(Path(prefix + ".killed").read_text())
        found["restart_s"] = rank0["starts"][0] - killed
        found["workers_s"] = rank0["fit_start"] - killed
    return found
