"""Train a small digits CNN on Ray workers; the same script on a laptop and on a Ray cluster.

On a laptop (a local Ray is started):

    python examples/cluster_job/train.py --num-workers 2

As a Ray job on a running cluster (the dashboard's address; `ray dashboard cluster.yaml` forwards it):

    ray job submit --address http://HEAD:8265 --working-dir examples/cluster_job -- \\
        python train.py --num-workers 4 --use-gpu

On a cluster made by `ray up examples/cluster.yaml` (`ray submit` uploads only this script; the
cluster's file_mounts make digits_model importable beside it):

    ray submit examples/cluster.yaml examples/cluster_job/train.py -- --num-workers 4 --use-gpu

The model and data live in ``digits_model.py`` next to this file. Workers import that module by
name, so it is shipped to every node with the job (see :func:`connect_to_ray`). After ``fit`` the
script prints where each worker ran, the validation metrics that came back to this process, and
the best checkpoint, which is a file on this machine even when rank 0 trained on another node.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import digits_model
import pytorch_lightning as pl
import ray
from digits_model import DigitsCNN, DigitsImages
from pytorch_lightning.callbacks import ModelCheckpoint

from ray_lightning import RayStrategy


def connect_to_ray(address: str | None) -> None:
    """Connect to Ray (``address``, else ``RAY_ADDRESS``/a local ``ray start``, else a new local Ray).

    Every worker unpickles the model by importing ``digits_model``, so the module has to reach
    every node:

    - As a Ray job submitted with ``--working-dir``, the job's working_dir already carries it: Ray
      unpacks it on each node and starts the workers in it. Nothing is added then: Ray 2.60 merges a
      driver's ``ray.init(runtime_env=...)`` into the job's only if they set different fields, and
      refuses the rest ("Failed to merge the Job's runtime env ...").
    - Everywhere else (a laptop, ``ray submit``, a client of a remote cluster), the module itself is
      shipped with ``py_modules``. This script's directory is not shipped as a working_dir: under
      ``ray submit`` it is the head node's home directory.
    """
    if ray.is_initialized():
        return  # the caller's own connection (e.g. a notebook's ray.init) and its runtime_env
    job_config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}"))
    job_runtime_env = job_config.get("runtime_env") or {}
    if {"working_dir", "py_modules"} & job_runtime_env.keys():
        runtime_env = None
    else:
        runtime_env = {"py_modules": [digits_model]}
    ray.init(address=address, runtime_env=runtime_env)


class WhereTrained(pl.Callback):
    """Records where every rank ran and which ``digits_model`` file it imported; rank 0 brings it back.

    The table travels to this process as the callback's state, like ModelCheckpoint's best path.
    """

    def __init__(self) -> None:
        self.ranks: list[dict[str, Any]] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import digits_model as imported  # resolved in the worker: the copy shipped to its node
        import torch.distributed as dist

        mine = {
            "rank": trainer.global_rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "module": imported.__file__,
        }
        table: list[Any] = [None] * trainer.world_size
        if dist.is_available() and dist.is_initialized():
            dist.all_gather_object(table, mine)
        else:
            table = [mine]
        self.ranks = table

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": self.ranks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.ranks = state_dict["ranks"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--cpus-per-worker", type=int, default=1)
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument(
        "--max-failures",
        type=int,
        default=3,
        help="restarts of the workers when a worker or node is lost, e.g. a spot instance taken back (%(default)s)",
    )
    parser.add_argument(
        "--output-dir",
        default=os.path.expanduser("~/ray_lightning_runs/cluster_job"),
        help="logs and checkpoints, on the machine this script runs on (default: %(default)s)",
    )
    parser.add_argument("--address", default=None, help="Ray cluster to use (default: RAY_ADDRESS or a local Ray)")
    args = parser.parse_args(argv)

    connect_to_ray(args.address)
    pl.seed_everything(0)
    checkpoint = ModelCheckpoint(monitor="val_acc", mode="max", filename="digits-{epoch}-{val_acc:.3f}")
    where = WhereTrained()
    strategy = RayStrategy(
        num_workers=args.num_workers,
        num_cpus_per_worker=args.cpus_per_worker,
        use_gpu=args.use_gpu,
        max_failures=args.max_failures,
    )
    trainer = pl.Trainer(
        max_epochs=args.max_epochs,
        strategy=strategy,
        callbacks=[checkpoint, where],
        default_root_dir=os.path.abspath(args.output_dir),
        enable_progress_bar=False,
    )
    model = DigitsCNN()
    trainer.fit(model, datamodule=DigitsImages())

    # Everything below ran on the workers and came back to this process.
    nodes = {r["node_id"] for r in where.ranks}
    print(f"\nTrained on {len(where.ranks)} worker(s) on {len(nodes)} node(s):")
    for r in where.ranks:
        print(f"  rank {r['rank']}: node {r['node_id']} ({r['ip']}, pid {r['pid']}), digits_model from {r['module']}")
    print("Validation metrics:")
    for name in ("val_acc", "val_loss"):
        print(f"  {name} = {float(trainer.callback_metrics[name]):.4f}")
    print(f"  after {trainer.current_epoch} epoch(s), {trainer.global_step} optimizer steps")
    for restart in trainer.strategy.restarts:
        print(
            f"  restart {restart.number}: rank {restart.rank} on {restart.node} ({restart.reason}), resumed in epoch "
            f"{restart.epoch} after step {restart.global_step}"
        )
    best = checkpoint.best_model_path
    restored = DigitsCNN.load_from_checkpoint(best)
    print(f"Best checkpoint on this machine: {best}")
    print(f"  val_acc {float(checkpoint.best_model_score):.4f}, reloaded with channels={restored.hparams.channels}")


if __name__ == "__main__":
    main()
