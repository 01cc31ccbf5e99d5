"""What a Tune trial's checkpoints cost the trial's process: its peak memory, and each rank's.

    .venv/bin/python -m benchmarks.tune_memory [--mb 256] [--epochs 2] [--out benchmarks/results]
    .venv/bin/python -m benchmarks.tune_memory --pbt [--mb 1024] [--epochs 3]

One trial per contender, in order, on one local Ray this process starts: a model of ``--mb`` MB of weights
(linear layers) trained with Adam by ``RayFSDPStrategy(num_workers=2)``, reporting each epoch:

* ``metrics``: ``TuneReportCallback``, no checkpoint (the floor);
* ``in_place``: ``TuneReportCheckpointCallback``, every rank writing its shards into Tune's checkpoint folder;
* ``through_trial``: the same callback made to send the full checkpoint through the trial's process as bytes
  (what it did before, and still does where fsspec cannot reach Tune's storage).

``--pbt``: a Population Based Training search of 2 trials x 2 workers over the learning rate (a perturbation at
every report), the model's layers made in ``configure_model`` (in the workers, as a model of this size is), two
contenders: ``in_place`` and ``ray_train`` (Ray Train v2 inside Tune as Ray documents it: the trial's function
drives a ``TorchTrainer`` whose loop uses Ray Train's Lightning ``RayFSDPStrategy`` and
``RayTrainReportCallback``; Tune's ``TuneReportCallback`` passes the reports on). Counted besides the peaks: PBT's
exploits, the exploits it skipped for want of a checkpoint, and the fits that resumed from a trial's checkpoint
(the ranks' first step, and the checkpoint folder's files).

Every process of a trial (its function's, each rank's) samples its own peak RSS (``ru_maxrss``) every 0.25 s into
a file named by role and pid, so that a process Tune stops (an exploit) still counts; a fresh trial process per
trial (``reuse_actors=False``), workers stopped after each fit. Writes ``<out>/<name>.json`` and
``<out>/<name>.md`` and prints the markdown. Nothing here asserts a figure: benchmarks/README.md reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.tune_memory_trials import ray_train_trial, train

CONTENDERS = ("metrics", "in_place", "through_trial")
PBT_CONTENDERS = ("in_place", "ray_train")


def _read_peaks(peaks: Path) -> dict[str, list[float]]:
    """The sampled peaks by role (``trial``, ``rank0``, ``rank1``): one value per process."""
    by_role: dict[str, list[float]] = {}
    for path in sorted(peaks.iterdir()):
        if "-" in path.name and not path.suffix:
            by_role.setdefault(path.name.split("-")[0], []).append(float(path.read_text()))
    return by_role


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _single(mode: str, config: dict[str, Any], scratch: str) -> dict[str, Any]:
    """One trial of ``mode``: its peaks and its fit's time."""
    from ray import tune

    from ray_lightning.tune import get_tune_resources

    analysis = tune.run(
        train,
        config={**config, "mode": mode},
        resources_per_trial=get_tune_resources(num_workers=2),
        storage_path=str(Path(scratch, "results")),
        reuse_actors=False,
        verbose=0,
    )
    (trial,) = analysis.trials
    if trial.status != "TERMINATED":
        raise RuntimeError(f"{mode}: the trial failed; see {trial.error_file}")
    checkpoint = trial.checkpoint.path if trial.checkpoint else None
    peaks = _read_peaks(Path(config["peaks"]))
    return {
        "trial_peak_mb": max(peaks["trial"]),
        "rank0_peak_mb": max(peaks.get("rank0", [0])),
        "rank1_peak_mb": max(peaks.get("rank1", [0])),
        "fit_s": trial.last_result["fit_s"],
        "checkpoint_entries": sorted(os.listdir(checkpoint)) if checkpoint else [],
    }


def _pbt(mode: str, config: dict[str, Any], scratch: str) -> dict[str, Any]:
    """A PBT search of 2 trials of ``mode``: every process's peak, PBT's exploits, and the fits that resumed."""
    import random

    import numpy as np
    from ray import tune
    from ray.tune.schedulers import PopulationBasedTraining

    from benchmarks.tune_measure import PbtLog
    from ray_lightning.tune import get_tune_resources

    random.seed(0)
    np.random.seed(0)
    lr = tune.loguniform(1e-5, 1e-3)
    scheduler = PopulationBasedTraining(time_attr="training_iteration", perturbation_interval=1,
                                        hyperparam_mutations={"lr": lr})  # fmt: skip
    if mode == "ray_train":
        trainable, metric = ray_train_trial, "val_loss"  # Tune's default resources; Train reserves its workers
    else:
        trainable = tune.with_resources(train, get_tune_resources(num_workers=2))
        metric = "loss"
    tuner = tune.Tuner(
        trainable,
        param_space={**config, "mode": mode, "pbt": True, "in_configure_model": True, "lr": lr},
        tune_config=tune.TuneConfig(
            metric=metric, mode="min", scheduler=scheduler, num_samples=2, reuse_actors=False
        ),  # fmt: skip
        run_config=tune.RunConfig(
            name=mode, storage_path=str(Path(scratch, "tune")), verbose=0, stop={"training_iteration": config["epochs"]}
        ),  # fmt: skip
    )
    started = time.perf_counter()
    with PbtLog() as pbt_log:
        grid = tuner.fit()
    wall = time.perf_counter() - started
    errors = [str(result.error)[-2000:] for result in grid if result.error is not None]
    peaks_dir = Path(config["peaks"])
    peaks = _read_peaks(peaks_dir)
    starts = _jsonl(peaks_dir / "starts.jsonl")
    return {
        "search_s": wall,
        "errors": errors,
        "trial_peak_mb": max(peaks["trial"]),
        "trial_processes": len(peaks["trial"]),
        "rank0_peak_mb": max(peaks.get("rank0", [0])),
        "rank1_peak_mb": max(peaks.get("rank1", [0])),
        "exploits": len(pbt_log.exploits),
        "exploits_skipped": len(pbt_log.skipped),
        "restores": _jsonl(peaks_dir / "restores.jsonl"),
        "resumed_fits": sorted({(s["trial"], s["step"]) for s in starts if s["step"] > 0}),
    }


def _markdown(args: argparse.Namespace, rows: dict[str, dict[str, Any]], weights_mb: float) -> str:
    if args.pbt:
        lines = [
            f"# A PBT search's checkpoints: peak memory (`{args.name}`)",
            "",
            f"2 trials x 2 workers, FSDP, {weights_mb:.0f} MB of weights made in `configure_model`, Adam (a full "
            f"checkpoint ~{3 * weights_mb:.0f} MB), {args.epochs} reports with a checkpoint each, PBT perturbing "
            "the learning rate at every report; one search per row.",
            "",
            "| contender | trial process peak MB | rank 0 peak MB | rank 1 peak MB | rank 0 / rank 1 | PBT exploits "
            "| exploits skipped: no checkpoint | fits resumed from a trial's checkpoint | search s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for mode, row in rows.items():
            ratio = row["rank0_peak_mb"] / row["rank1_peak_mb"] if row["rank1_peak_mb"] else 0
            lines.append(
                f"| {mode} | {row['trial_peak_mb']:.0f} | {row['rank0_peak_mb']:.0f} | {row['rank1_peak_mb']:.0f} "
                f"| x{ratio:.2f} | {row['exploits']} | {row['exploits_skipped']} | {len(row['resumed_fits'])} "
                f"| {row['search_s']:.0f} |"
            )
        for mode, row in rows.items():
            files = sorted({name for restore in row["restores"] for name in restore["files"]})
            lines.append(f"\n{mode}: checkpoint files a restored trial was given: {files}; errors: {row['errors']}")
        return "\n".join(lines) + "\n"
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
    floor = rows["metrics"]["trial_peak_mb"] if "metrics" in rows else 0
    for mode, row in rows.items():
        ratio = row["rank0_peak_mb"] / row["rank1_peak_mb"] if row["rank0_peak_mb"] and row["rank1_peak_mb"] else 0
        lines.append(
            f"| {mode} | {row['trial_peak_mb']:.0f} | +{row['trial_peak_mb'] - floor:.0f} | {row['rank0_peak_mb']:.0f} "
            f"| {row['rank1_peak_mb']:.0f} | x{ratio:.2f} | {row['fit_s']:.1f} |"
        )
    if "in_place" in rows:
        lines += ["", f"Tune's checkpoint folder (in_place): {rows['in_place']['checkpoint_entries']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=None, help="MB of weights (4 square layers; 256, --pbt 1024)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs, one report each (2, --pbt 3)")
    parser.add_argument("--pbt", action="store_true", help="a PBT search of 2 trials against Ray Train in Tune")
    parser.add_argument("--contenders", default=None, help="comma-separated subset of the contenders")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    args.mb = args.mb or (1024 if args.pbt else 256)
    args.epochs = args.epochs or (3 if args.pbt else 2)
    kind = "tune-pbt-memory" if args.pbt else "tune-memory"
    args.name = args.name or time.strftime(f"{kind}-%Y%m%d-%H%M%S", time.gmtime())
    contenders = args.contenders.split(",") if args.contenders else (PBT_CONTENDERS if args.pbt else CONTENDERS)
    import ray

    layers = 4
    dim = int((args.mb * 2**20 / 4 / layers) ** 0.5)
    ray.init(num_cpus=8, include_dashboard=False, logging_level="ERROR")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="ray_lightning-tune-memory-") as scratch:
        for mode in contenders:
            peaks = Path(scratch, f"peaks-{mode}")
            peaks.mkdir()
            config = {"dim": dim, "layers": layers, "epochs": args.epochs, "peaks": str(peaks), "scratch": scratch}
            try:
                rows[mode] = (_pbt if args.pbt else _single)(mode, config, scratch)
            except RuntimeError as error:
                print(error, file=sys.stderr)
                return 1
    ray.shutdown()
    markdown = _markdown(args, rows, layers * dim * dim * 4 / 2**20)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    (out / f"{args.name}.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
