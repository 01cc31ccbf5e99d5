"""A Hydra application that trains the digits classifier on Ray workers, configured by examples/conf/hydra_app.yaml.

    python examples/hydra_app.py                                  # one run, in outputs/<date>/<time>/
    python examples/hydra_app.py strategy.num_workers=4 trainer.max_epochs=10
    python examples/hydra_app.py -m model.lr=0.01,0.05            # a sweep, in multirun/<date>/<time>/<job>/

Each run writes its Lightning logs, checkpoints and ``metrics.json`` into its own Hydra output
directory. Lightning's ``ddp`` strategy does not mix with Hydra: it starts each extra rank by
running this script again from ``sys.argv``, so the job's code runs once more per rank, and in a
sweep (``-m``) each re-launch runs the whole sweep again. ``RayStrategy`` never re-runs the script:
the workers are Ray actors that receive the Trainer and module, so each job runs exactly once, in
this process, wherever Hydra put it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import hydra
import pytorch_lightning as pl
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf


@hydra.main(version_base="1.3", config_path="conf", config_name="hydra_app")
def main(cfg: DictConfig) -> float:
    """Train once with ``cfg``; return the final ``val_acc`` (what an optimising sweeper would maximise)."""
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    # One line per job and process: a script re-launched per rank would print it again.
    print(f"hydra_app: job starts in {output_dir} (pid {os.getpid()})", flush=True)

    pl.seed_everything(cfg.seed)
    # _convert_="all": the Trainer, callbacks and strategy get plain lists and dicts, not OmegaConf nodes.
    strategy = instantiate(cfg.strategy, _convert_="all")
    trainer: pl.Trainer = instantiate(cfg.trainer, strategy=strategy, default_root_dir=str(output_dir), _convert_="all")
    model: pl.LightningModule = instantiate(cfg.model)
    trainer.fit(model, datamodule=instantiate(cfg.data))

    checkpoint = trainer.checkpoint_callback
    results = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "metrics": {name: float(value) for name, value in trainer.callback_metrics.items()},
        "epochs": trainer.current_epoch,
        "global_step": trainer.global_step,
        "best_checkpoint": checkpoint.best_model_path if checkpoint else None,
        "log_dir": trainer.log_dir,
    }
    (output_dir / "metrics.json").write_text(json.dumps(results, indent=2))
    print(f"hydra_app: val_acc={results['metrics']['val_acc']:.4f}, results in {output_dir / 'metrics.json'}")
    return results["metrics"]["val_acc"]


if __name__ == "__main__":
    main()
