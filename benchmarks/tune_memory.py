"""What a Tune trial's checkpoints cost the trial's process: its peak memory, and each rank's.

    .venv/bin/python -m benchmarks.tune_memory [--mb 256] [--epochs 2] [--out benchmarks/results]

One trial per contender, in order, on one local Ray this process starts: a model of ``--mb`` MB of weights
(linear layers) trained with Adam by ``RayFSDPStrategy(num_workers=2)``, reporting each epoch:

* ``metrics``: ``TuneReportCallback``, no checkpoint (the floor);
* ``in_place``: ``TuneReportCheckpointCallback``, every rank writing its shards into Tune's checkpoint folder;
* ``through_trial``: the same callback made to send the full checkpoint through the trial's process as bytes
  (what it did before, and still does where fsspec cannot reach Tune's storage).

Each trial's process reports its own peak RSS (``ru_maxrss``) at its end, each rank its own; a fresh trial
process per contender (``reuse_actors=False``), workers stopped after each fit. Writes ``<out>/<name>.json`` and
``<out>/<name>.md`` and prints the markdown. Nothing here asserts a figure: benchmarks/README.md reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

CONTENDERS = ("metrics", "in_place", "through_trial")


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def train(config: dict) -> None:
    """The trial's function: one fit; the trial's and each rank's peak RSS reported at its end."""
    import pytorch_lightning as pl
    import torch
    from ray import tune
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import ray_lightning.tune as rl_tune
    from ray_lightning import RayFSDPStrategy
    from ray_lightning.tune import trial

    if config["mode"] == "through_trial":
        trial.ranks_write_to_tune_storage = lambda: False  # the path taken where fsspec cannot reach the storage
    dim, peaks = config["dim"], config["peaks"]

    class Wide(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(config["layers"])))

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.layers(x).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            (x,) = batch
            self.log("val_loss", self.layers(x).pow(2).mean(), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(16, dim)), batch_size=4)

        def val_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(8, dim)), batch_size=4)

    class RankPeak(pl.Callback):
        def on_fit_end(self, trainer, pl_module):
            Path(peaks, f"rank{trainer.global_rank}").write_text(str(_peak_mb()))

    report = (
        rl_tune.TuneReportCallback({"loss": "val_loss"})
        if config["mode"] == "metrics"
        else rl_tune.TuneReportCheckpointCallback({"loss": "val_loss"})
    )
    trainer = pl.Trainer(
        max_epochs=config["epochs"],
        strategy=RayFSDPStrategy(num_workers=2, keep_workers_alive_s=0, full_weights_home=False),
        callbacks=[report, RankPeak()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    started = time.perf_counter()
    trainer.fit(Wide())
    tune.report({"trial_peak_mb": _peak_mb(), "fit_s": time.perf_counter() - started})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="MB of weights (4 square layers; 256)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs, one report each (2)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default=time.strftime("tune-memory-%Y%m%d-%H%M%S", time.gmtime()))
    args = parser.parse_args(argv)
    import ray
    from ray import tune

    from ray_lightning.tune import get_tune_resources

    layers = 4
    dim = int((args.mb * 2**20 / 4 / layers) ** 0.5)
    ray.init(num_cpus=6, include_dashboard=False, logging_level="ERROR")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="ray_lightning-tune-memory-") as scratch:
        for mode in CONTENDERS:
            peaks = Path(scratch, mode)
            peaks.mkdir()
            analysis = tune.run(
                train,
                config={"mode": mode, "dim": dim, "layers": layers, "epochs": args.epochs, "peaks": str(peaks)},
                resources_per_trial=get_tune_resources(num_workers=2),
                storage_path=str(Path(scratch, "results")),
                reuse_actors=False,
                verbose=0,
            )
            (trial,) = analysis.trials
            if trial.status != "TERMINATED":
                print(f"{mode}: the trial failed; see {trial.error_file}", file=sys.stderr)
                return 1
            ranks = {p.name: float(p.read_text()) for p in sorted(peaks.iterdir())}
            checkpoint = trial.checkpoint.path if trial.checkpoint else None
            rows[mode] = {
                "trial_peak_mb": trial.last_result["trial_peak_mb"],
                "rank0_peak_mb": ranks.get("rank0"),
                "rank1_peak_mb": ranks.get("rank1"),
                "fit_s": trial.last_result["fit_s"],
                "checkpoint_entries": sorted(os.listdir(checkpoint)) if checkpoint else [],
            }
    ray.shutdown()
    weights_mb = layers * dim * dim * 4 / 2**20
    lines = [
        f"# A Tune trial's checkpoints: peak memory (`{args.name}`)",
        "",
        f"RayFSDPStrategy(num_workers=2), {weights_mb:.0f} MB of weights, Adam (a full checkpoint ~{3 * weights_mb:.0f}"
        f" MB), {args.epochs} reports with a checkpoint each; one trial per row, a fresh trial process each.",
        "",
        "| contender | trial process peak MB | over `metrics` | rank 0 peak MB | rank 1 peak MB | rank 0 / rank 1 "
        "| fit s |",
        "|---|---|---|---|---|---|---|",
    ]
    floor = rows["metrics"]["trial_peak_mb"]
    for mode, row in rows.items():
        ratio = row["rank0_peak_mb"] / row["rank1_peak_mb"] if row["rank0_peak_mb"] and row["rank1_peak_mb"] else 0
        lines.append(
            f"| {mode} | {row['trial_peak_mb']:.0f} | +{row['trial_peak_mb'] - floor:.0f} | {row['rank0_peak_mb']:.0f} "
            f"| {row['rank1_peak_mb']:.0f} | x{ratio:.2f} | {row['fit_s']:.1f} |"
        )
    lines += ["", f"Tune's checkpoint folder (in_place): {rows['in_place']['checkpoint_entries']}"]
    markdown = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    (out / f"{args.name}.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
