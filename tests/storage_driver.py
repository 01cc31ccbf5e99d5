"""A driver script for tests/test_storage.py: a fit that keeps its run in a bucket, run as its own process.

``python -m tests.storage_driver <storage_path> <run_name> <weights out> [hold]``: with ``hold``, rank 0
stops at the first batch of epoch 2 (after epoch 1's recovery checkpoint) until the driver is killed
(bounded: it fails after 300 s), so that the test kills the driver mid-fit, never after it finished.
"""

from __future__ import annotations

import os
import sys
import time

import pytorch_lightning as pl
import torch

from ray_lightning import RayStrategy
from tests.models import BoringModel

HOLD_S = 300.0


class HoldsAtEpochTwo(BoringModel):
    def __init__(self, hold: bool) -> None:
        super().__init__()
        self.hold = hold

    def training_step(self, batch, batch_idx):
        if self.hold and self.global_rank == 0 and (self.current_epoch, batch_idx) == (2, 0):
            deadline = time.monotonic() + HOLD_S
            while time.monotonic() < deadline:  # the test kills this run's driver meanwhile
                time.sleep(0.5)
            raise RuntimeError(f"the driver was not killed within {HOLD_S} s")
        return super().training_step(batch, batch_idx)


def main(storage_path: str, run_name: str, out: str, hold: bool) -> None:
    pl.seed_everything(0)
    model = HoldsAtEpochTwo(hold)
    trainer = pl.Trainer(
        max_epochs=4,
        strategy=RayStrategy(num_workers=2, storage_path=storage_path, run_name=run_name, keep_workers_alive_s=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model)
    print(f"finished at epoch {trainer.current_epoch}, step {trainer.global_step}", flush=True)
    torch.save(model.state_dict(), out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], len(sys.argv) > 4 and sys.argv[4] == "hold")
    os._exit(0)  # the cluster is the test's: leave it without waiting for this driver's Ray to wind down
