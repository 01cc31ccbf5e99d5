"""The digits example behind Lightning's command line (``LightningCLI``), trained on Ray workers.

    python examples/cli_digits.py fit --trainer.strategy=ray_lightning.RayStrategy \\
        --trainer.strategy.num_workers=2 --trainer.max_epochs=1
    python examples/cli_digits.py fit --trainer.strategy=ray_lightning.HorovodRayStrategy \\
        --trainer.strategy.num_workers=2 --model.lr=0.05 --data.batch_size=32
    python examples/cli_digits.py fit --trainer.strategy=ray_lightning.RayStrategy --print_config > digits.yaml
    python examples/cli_digits.py fit --config digits.yaml

Every argument of ``pl.Trainer``, ``RayStrategy`` (or ``HorovodRayStrategy``), ``DigitsClassifier``
and ``DigitsDataModule`` is an option; ``--help`` lists them.
"""

from __future__ import annotations

from pytorch_lightning.cli import LightningCLI
from train_digits import DigitsClassifier, DigitsDataModule


def main() -> None:
    """Parse the command line, run the subcommand (``fit``, ``validate``...), print the metrics that came back."""
    cli = LightningCLI(DigitsClassifier, DigitsDataModule)
    trainer = cli.trainer
    strategy = type(trainer.strategy).__name__
    # Computed on the workers, back in this process.
    metrics = ", ".join(f"{name}={float(value):.4f}" for name, value in sorted(trainer.callback_metrics.items()))
    print(f"cli_digits: {strategy} with {trainer.world_size} worker(s): epochs={trainer.current_epoch} {metrics}")


if __name__ == "__main__":
    main()
