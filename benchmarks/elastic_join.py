"""A node joins an elastic fit: how long until the fit trains on it, and how long the running ranks pause.

    .venv/bin/python -m benchmarks.elastic_join        # from the repository root; prints one JSON line

One ``ray.cluster_utils.Cluster`` in this process: a head without CPUs and two 1-CPU worker nodes. A
``RayStrategy(num_workers=(2, 3))`` fit (a linear model, 50 ms of sleep per step: a node's own compute) starts on
both; after rank 0's 40th batch a third node is added. Reported: the node's add, node added → grow decided
(``Restart.failed_at``), node added → rank 0's first batch on 3, the pause (rank 0's last batch on 2 → its first on
3), the grow's source and steps trained twice, and rank 0's pids (one: its process was kept). Times from rank 0's
batch ends (``time.time()``, one machine). The room is beyond the fit's reservation, so this is the path
:mod:`ray_lightning.launch.elastic` reserves a second placement group for; the spot benchmark (``benchmarks.elastic``)
measures the grow back into the fit's own reservation.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time

import pytorch_lightning as pl
import ray
import torch
from ray.cluster_utils import Cluster
from torch.utils.data import DataLoader, TensorDataset

from ray_lightning import RayStrategy

SLOT = {"CPU": 1, "slot": 1}


class SlowSteps(pl.LightningModule):
    """A linear regressor whose steps sleep 50 ms; rank 0 appends each batch end (time, world size, pid) to ``log``."""

    def __init__(self, log: str, size: int) -> None:
        super().__init__()
        self.log_path, self.size = log, size
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(0.05)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(self.size, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.global_rank == 0:
            row = {"t": time.time(), "world": self.trainer.world_size, "pid": os.getpid()}
            with open(self.log_path, "a") as f:
                f.write(json.dumps(row) + "\n")


def _rows(log: str) -> list[dict]:
    return [json.loads(line) for line in open(log)] if os.path.exists(log) else []


def main() -> None:
    log = os.path.join(tempfile.mkdtemp(prefix="elastic-join-"), "batches.jsonl")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"slot": 1})
    ray.init(address=cluster.address)
    strategy = RayStrategy(num_workers=(2, 3), resources_per_worker=SLOT, grow_check_interval_s=0,
                           recovery_checkpoint_every_n_steps=5, max_failures=1)  # fmt: skip
    trainer = pl.Trainer(max_epochs=1, strategy=strategy, enable_progress_bar=False, logger=False,
                         enable_checkpointing=False)  # fmt: skip
    # The fit in a thread: Ray's Cluster adds nodes from the main thread only.
    fit = threading.Thread(target=trainer.fit, args=(SlowSteps(log, size=9600),), daemon=True)
    fit.start()
    while len(_rows(log)) < 40 and fit.is_alive():
        time.sleep(0.1)
    asked = time.time()
    cluster.add_node(num_cpus=1, resources={"slot": 1})
    added = time.time()
    fit.join(600)
    rows = _rows(log)
    grow = next(r for r in trainer.strategy.restarts if r.reason == "grow")
    on_three = next(r for r in rows if r["world"] == 3)
    last_on_two = [r for r in rows if r["t"] < on_three["t"]][-1]
    print(json.dumps({
        "add_node_s": round(added - asked, 2),
        "added_to_decided_s": round(grow.failed_at - added, 2),
        "added_to_training_on_3_s": round(on_three["t"] - added, 2),
        "pause_s": round(on_three["t"] - last_on_two["t"], 2),
        "grow": {"world_size": grow.world_size, "source": grow.source, "steps_lost": grow.steps_lost},
        "rank_zero_pids": sorted({r["pid"] for r in rows}),
    }))  # fmt: skip
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
