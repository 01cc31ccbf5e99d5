"""A restored trial keeps the hyperparameters it configured: what PBT mutated stays in force over the checkpoint's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytorch_lightning as pl

# Where a checkpoint keeps the optimizer settings configure_optimizers made in the fit that wrote it.
SETTINGS_KEY = "ray_lightning_tune_optimizer_settings"


def keep_configured_settings(
    trainer: pl.Trainer, configured: list[list[dict[str, Any]]], restored: list[list[dict[str, Any]]]
) -> list[str]:
    """After Lightning loaded the optimizers' states: each setting this fit configured otherwise than the fit
    that wrote the checkpoint takes this fit's value again. Returns what was kept, for the log."""
    kept = []
    schedulers = [config.scheduler for config in getattr(trainer, "lr_scheduler_configs", [])]
    for index, (optimizer, mine, theirs) in enumerate(zip(trainer.optimizers, configured, restored)):
        for group_index, (group, own, other) in enumerate(zip(optimizer.param_groups, mine, theirs)):
            changed = {k: v for k, v in own.items() if k in other and other[k] != v and k in group}
            for key, value in changed.items():
                if key == "lr" and isinstance(group[key], float) and other[key]:
                    # A schedule's progress since the start stays: the new rate scaled as the old one was.
                    group[key] = value * group[key] / other[key]
                    _rebase_schedulers(schedulers, optimizer, group_index, value)
                else:
                    group[key] = value
                kept.append(f"optimizer {index} group {group_index} {key}={group[key]!r} (checkpoint: {other[key]!r})")
    return kept


def _rebase_schedulers(schedulers: list[Any], optimizer: Any, group_index: int, lr: float) -> None:
    """Schedulers compute from their base rates, which loading restored to the checkpoint's."""
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is optimizer and hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs[group_index] = lr
