"""Train a digits classifier with Lightning Fabric on 2 Ray workers: a hand-written training loop, run by
``fabric.launch(train)`` on Ray actors, whose result comes back to this process.

    python3 dev.py example --fabric              # via the project's command (sets up .venv)
    python examples/fabric_digits.py --num-workers 4 --max-epochs 10
    python examples/fabric_digits.py --max-failures 1   # a worker that dies: train runs again and continues
    RAY_ADDRESS=auto python examples/fabric_digits.py   # on a running Ray cluster

With no Ray running, a local Ray is started on the spot. The data is scikit-learn's bundled 8x8 digits, so
nothing is downloaded. The metrics (CSV) and a checkpoint per epoch go to lightning_logs/fabric_digits/version_N/
in this process's working directory: the workers resolve relative paths against it.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import numpy as np
import torch
from lightning.fabric.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from ray_lightning import RayStrategy

CHANCE = 0.1  # ten classes


def digits() -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.from_numpy(np.random.RandomState(0).permutation(len(x)))
    x, y = x[order], y[order]
    return TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])


def train(fabric: L.Fabric, args: argparse.Namespace, checkpoint: str) -> dict[str, float]:
    """Runs on every Ray worker (rank ``fabric.global_rank`` of ``fabric.world_size``); rank 0's return value
    is what ``fabric.launch`` returns on the driver."""
    fabric.seed_everything(0)
    train_set, val_set = digits()
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, optimizer = fabric.setup(model, optimizer)
    # Each rank gets its own share of every epoch (Fabric adds a DistributedSampler).
    train_loader, val_loader = fabric.setup_dataloaders(
        DataLoader(train_set, batch_size=args.batch_size, shuffle=True),
        DataLoader(val_set, batch_size=args.batch_size),
    )

    # Resuming: with max_failures=N a worker that dies makes ray_lightning stop this call and run train() again
    # on new workers, from the start of this function. What it continues from is its own last fabric.save: load
    # it if it is there. Rank 0 decides, so that every rank loads or none does.
    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    if fabric.broadcast(os.path.exists(checkpoint)):
        fabric.load(checkpoint, state)  # restores the weights and the optimizer in place, and "epoch"
        fabric.print(f"Resumed from {checkpoint} after epoch {state['epoch']}")

    metrics: dict[str, float] = {}
    for epoch in range(state["epoch"], args.max_epochs):
        train_loader.sampler.set_epoch(epoch)  # another order each epoch, the same on every rank
        model.train()
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()

        model.eval()
        totals = torch.zeros(3, device=fabric.device)  # summed loss, correct predictions, rows
        with torch.no_grad():
            for x, y in val_loader:
                logits = model(x)
                loss_sum = F.cross_entropy(logits, y, reduction="sum").item()
                correct = (logits.argmax(1) == y).sum().item()
                totals += torch.tensor([loss_sum, correct, len(y)], device=fabric.device)
        loss_sum, correct, rows = fabric.all_reduce(totals, reduce_op="sum").tolist()  # every rank's rows
        metrics = {"train_loss": loss.item(), "val_loss": loss_sum / rows, "val_acc": correct / rows}
        fabric.log_dict({**metrics, "epoch": epoch}, step=epoch)  # rank 0 writes the CSV
        fabric.print(f"epoch {epoch}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

        state["epoch"] = epoch + 1
        fabric.save(checkpoint, state)  # rank 0 writes it (a relative path: in the driver's working directory)

    fabric.logger.finalize("success")  # writes out the CSV rows not yet flushed (ray_lightning does it too)
    return {**metrics, "epochs": state["epoch"]}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--max-failures", type=int, default=0, help="restarts of train() after a worker dies")
    args = parser.parse_args(argv)

    strategy = RayStrategy(num_workers=args.num_workers, use_gpu=args.use_gpu, max_failures=args.max_failures)
    # One row per epoch: each is written out as it comes. (A restarted train() appends to the rows written before.)
    logger = CSVLogger(root_dir="lightning_logs", name="fabric_digits", flush_logs_every_n_steps=1)
    fabric = L.Fabric(strategy=strategy, loggers=logger)
    # The run's directory (lightning_logs/fabric_digits/version_N), chosen here once: a restarted train() gets
    # the same path, so it finds the checkpoint its previous attempt saved; the next run of this script starts afresh.
    checkpoint = os.path.join(logger.log_dir, "last.ckpt")

    result = fabric.launch(train, args, checkpoint)  # train(fabric, args, checkpoint) on the Ray workers

    print("\nFinal validation metrics (from rank 0):")
    for name, value in result.items():
        print(f"  {name} = {value:.4f}" if isinstance(value, float) else f"  {name} = {value}")
    print(f"  metrics: {os.path.join(logger.log_dir, 'metrics.csv')}, last checkpoint: {checkpoint}")
    for restart in strategy.restarts:
        print(f"  restarted after: {restart.cause}")
    if result["val_acc"] < 3 * CHANCE:
        sys.exit(f"val_acc {result['val_acc']:.4f} is not clearly above chance ({CHANCE})")
    return result


if __name__ == "__main__":
    main()
