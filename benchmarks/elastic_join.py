"""A node joins an elastic fit: how long until the fit trains on it, and how long the running ranks pause.

    .venv/bin/python -m benchmarks.elastic_join [ray_lightning] [ray_train] [--out DIR]   # from the repository root

Each contender on a ``ray.cluster_utils.Cluster`` of its own in this process: a head without CPUs and two 1-CPU
worker nodes. Its fit (a linear model, 50 ms of sleep per step: a node's own compute, a checkpoint every 5 steps)
starts on both; after rank 0's 40th batch a third node is added. The contenders: ``RayStrategy(num_workers=(2, 3))``
(the room is beyond the fit's reservation: :mod:`ray_lightning.launch.elastic` reserves it as a second placement group
and grows in the running processes) and Ray Train v2's ``ScalingConfig(num_workers=(2, 3))`` (its resize monitor every
second; it restarts its workers from the last reported checkpoint). Reported, one JSON line each, then the ratios of
this run: the node's add, node added → grow decided (RayStrategy's ``Restart.failed_at``), node added → rank 0's
first batch on 3, the pause (rank 0's last batch on 2 → its first on 3), the grow's source and the steps trained
twice, and rank 0's processes (one: its process was kept). Times from rank 0's batch ends (``time.time()``, one
machine). The spot benchmark (``benchmarks.elastic``) measures the grow back into the fit's own reservation.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time

import ray
import torch
from ray.cluster_utils import Cluster
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.workload import pl  # the namespace Ray Train's Lightning utilities take
from ray_lightning import RayStrategy

SLOT = {"CPU": 1, "slot": 1}
SIZE = 9600  # samples: 600 steps on 2 workers of 8 samples each


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
            row = {"t": time.time(), "world": self.trainer.world_size, "pid": os.getpid(), "step": self.global_step}
            with open(self.log_path, "a") as f:
                f.write(json.dumps(row) + "\n")


def _rows(log: str) -> list[dict]:
    return [json.loads(line) for line in open(log)] if os.path.exists(log) else []


def _ray_lightning(log: str) -> dict:
    """RayStrategy(num_workers=(2, 3)) with a recovery checkpoint every 5 steps; returns its grow's record."""
    strategy = RayStrategy(num_workers=(2, 3), resources_per_worker=SLOT, grow_check_interval_s=0,
                           recovery_checkpoint_every_n_steps=5, max_failures=1)  # fmt: skip
    trainer = pl.Trainer(max_epochs=1, strategy=strategy, enable_progress_bar=False, logger=False,
                         enable_checkpointing=False)  # fmt: skip
    trainer.fit(SlowSteps(log, size=SIZE))
    grow = next(r for r in trainer.strategy.restarts if r.reason == "grow")
    return {"decided_at": grow.failed_at, "source": grow.source}


def _ray_train_loop(config: dict) -> None:
    """Ray Train's loop: its documented Lightning integration, a checkpoint reported every 5 steps (as the
    RayStrategy contender's recovery checkpoints), resumed from ``ray.train.get_checkpoint()`` after a resize."""
    import ray.train
    from ray.train.lightning import RayTrainReportCallback

    from benchmarks.workload import ray_train_trainer

    class EveryFiveSteps(RayTrainReportCallback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step % 5 == 0:
                super().on_train_epoch_end(trainer, pl_module)

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            pass

    arguments = {"max_epochs": 1, "enable_progress_bar": False, "logger": False, "enable_checkpointing": False}
    trainer = ray_train_trainer(arguments, [EveryFiveSteps()])
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        trainer.fit(SlowSteps(config["log"], size=SIZE))
        return
    if ray.train.get_context().get_world_rank() == 0:  # what the driver reports as the grow's source
        open(_resumed(config["log"]), "a").close()
    with checkpoint.as_directory() as directory:
        path = os.path.join(directory, RayTrainReportCallback.CHECKPOINT_NAME)
        trainer.fit(SlowSteps(config["log"], size=SIZE), ckpt_path=path)


def _resumed(log: str) -> str:
    """The file rank 0 of a Ray Train attempt creates when it resumed from a reported checkpoint."""
    return os.path.join(os.path.dirname(log), "resumed-from-checkpoint")


def _ray_train(log: str) -> dict:
    """Ray Train v2's TorchTrainer, ScalingConfig(num_workers=(2, 3)), its resize monitor every second."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    scaling = ScalingConfig(num_workers=(2, 3), resources_per_worker=SLOT, elastic_resize_monitor_interval_s=1)
    run = RunConfig(storage_path=os.path.dirname(log), name="ray_train", failure_config=FailureConfig(max_failures=1))
    TorchTrainer(_ray_train_loop, train_loop_config={"log": log}, scaling_config=scaling, run_config=run).fit()
    return {"decided_at": None, "source": "checkpoint" if os.path.exists(_resumed(log)) else None}


CONTENDERS = {"ray_lightning": _ray_lightning, "ray_train": _ray_train}


def measure(name: str) -> dict:
    """One contender on a cluster of its own: it starts on two nodes, a third joins after rank 0's 40th batch."""
    log = os.path.join(tempfile.mkdtemp(prefix="elastic-join-"), "batches.jsonl")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, resources={"slot": 1})
        ray.init(address=cluster.address)
        # The fit in a thread: Ray's Cluster adds nodes from the main thread only.
        result: dict = {}
        fit = threading.Thread(target=lambda: result.update(CONTENDERS[name](log)), daemon=True)
        fit.start()
        while len(_rows(log)) < 40 and fit.is_alive():
            time.sleep(0.1)
        asked = time.time()
        cluster.add_node(num_cpus=1, resources={"slot": 1})
        added = time.time()
        fit.join(600)
    finally:
        ray.shutdown()
        cluster.shutdown()
    rows = _rows(log)
    on_three = next(r for r in rows if r["world"] == 3)
    on_two = [r for r in rows if r["t"] < on_three["t"]]
    decided = result.get("decided_at")
    return {
        "contender": name,
        "add_node_s": round(added - asked, 2),
        "added_to_decided_s": round(decided - added, 2) if decided else None,
        "added_to_training_on_3_s": round(on_three["t"] - added, 2),
        "pause_s": round(on_three["t"] - on_two[-1]["t"], 2),
        "source": result.get("source"),
        # Steps rank 0 trained on 2 that the fit on 3 trained again (it went on from an older step).
        "steps_trained_twice": on_two[-1]["step"] - on_three["step"] + 1,
        "rank_zero_pids": len({r["pid"] for r in rows}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("contenders", nargs="*", help=f"of {', '.join(CONTENDERS)} (default: both)")
    parser.add_argument("--out", help="a folder: the rows also go to elastic_join.json there")
    args = parser.parse_args()
    if unknown := set(args.contenders) - set(CONTENDERS):
        parser.error(f"unknown contender(s) {sorted(unknown)}: choose from {list(CONTENDERS)}")
    rows = [measure(name) for name in args.contenders or list(CONTENDERS)]
    for row in rows:
        print(json.dumps(row))
    if args.out:
        with open(os.path.join(args.out, "elastic_join.json"), "w") as f:
            json.dump(rows, f)
    if len(rows) == 2:  # the ratios of this run, RayStrategy's against Ray Train's
        for key in ("added_to_training_on_3_s", "pause_s"):
            print(f"{key}: ray_lightning x{rows[0][key] / rows[1][key]:.2f} of ray_train")


if __name__ == "__main__":
    main()
