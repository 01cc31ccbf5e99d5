"""Elastic workers, ``num_workers=(min, max)``: how many, what a resize does to the batch, how often growth is checked.

Decisions:

* A fit of ``(min, max)`` workers starts on as many as the cluster can place at once (at least ``min``;
  it waits for ``min`` within ``placement_timeout_s``), restarts on fewer after a lost node without
  waiting for a replacement, and grows back toward ``max`` at a recovery checkpoint (an epoch's end, or every
  ``recovery_checkpoint_every_n_steps`` steps) once the cluster can hold more (checked at most every
  ``grow_check_interval_s``).
* ``max`` is the reference size: the global batch and the learning rate the user wrote are those of
  ``max`` workers. ``batch_policy`` says what a resize does:

  - ``"keep_global_batch"`` (default): the global batch of ``max`` workers is kept, the per-worker batch
    and ``accumulate_grad_batches`` change (the per-worker batch never grows: more accumulation first, so
    a worker's memory use does not grow on fewer workers); sizes that cannot be kept fail at the first
    fit, naming them. Same steps per epoch, same optimizer trajectory as ``max`` workers.
  - ``"scale_lr"``: the per-worker batch is kept, the learning rate of every param group (and its
    schedulers' base rates) is scaled by ``world_size / max`` (Goyal et al.'s linear scaling rule).
  - ``"leave"``: neither is changed; more optimizer steps per epoch on fewer workers.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from typing import Any

from ray_lightning.config.variables import BATCH_POLICY_ENV, GROW_CHECK_INTERVAL_ENV, NUM_WORKERS_ENV, seconds

BATCH_POLICIES = ("keep_global_batch", "scale_lr", "leave")
DEFAULT_GROW_CHECK_INTERVAL_S = 30.0


@dataclass(frozen=True)
class ElasticSettings:
    """``min_workers``..``max_workers`` workers (equal: a fixed size), the batch policy, the growth check's interval."""

    min_workers: int
    max_workers: int
    batch_policy: str = "keep_global_batch"
    grow_check_interval_s: float = DEFAULT_GROW_CHECK_INTERVAL_S

    @property
    def enabled(self) -> bool:
        return self.min_workers < self.max_workers

    @classmethod
    def resolve(cls, num_workers: Any, batch_policy: Any = None, grow_check_interval_s: Any = None) -> ElasticSettings:
        """Check the arguments (a bad one raises naming it); those left as None come from the environment."""
        low, high = worker_range(num_workers)
        source = "batch_policy"
        if batch_policy is None:
            source, batch_policy = f"{BATCH_POLICY_ENV} (environment variable)", os.environ.get(BATCH_POLICY_ENV)
        policy = batch_policy if batch_policy is not None else BATCH_POLICIES[0]
        if policy not in BATCH_POLICIES:
            raise ValueError(f"{source} must be one of {', '.join(map(repr, BATCH_POLICIES))}, got {policy!r}.")
        interval = seconds(
            "grow_check_interval_s", grow_check_interval_s, GROW_CHECK_INTERVAL_ENV, DEFAULT_GROW_CHECK_INTERVAL_S, True
        )
        return cls(low, high, policy, interval)


def worker_range(num_workers: Any) -> tuple[int, int]:
    """``(min, max)`` from ``num_workers``: an int (a fixed size) or a pair of ints, checked."""
    if isinstance(num_workers, (tuple, list)):
        if len(num_workers) != 2 or not all(_is_int(n) for n in num_workers):
            raise TypeError(f"num_workers must be an int or a pair (min, max) of ints, got {num_workers!r}.")
        low, high = (int(n) for n in num_workers)
        if not 1 <= low <= high:
            raise ValueError(f"num_workers=(min, max) needs 1 <= min <= max, got {tuple(num_workers)!r}.")
        return low, high
    if not _is_int(num_workers):
        raise TypeError(f"num_workers must be an int >= 1 or a pair (min, max), got {num_workers!r}.")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers!r}.")
    return int(num_workers), int(num_workers)


def num_workers_from_environment(default: Any) -> Any:
    """``RAY_LIGHTNING_NUM_WORKERS`` for a strategy whose ``num_workers`` was left out: ``"4"`` or ``"2,4"``."""
    raw = os.environ.get(NUM_WORKERS_ENV, "").strip()
    if not raw:
        return default
    parts = [p.strip() for p in raw.replace(":", ",").split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ValueError(
            f"{NUM_WORKERS_ENV} (environment variable) must be a whole number or 'min,max', got {raw!r}."
        ) from None
    if len(values) > 2:
        raise ValueError(f"{NUM_WORKERS_ENV} (environment variable) must be a whole number or 'min,max', got {raw!r}.")
    return values[0] if len(values) == 1 else (values[0], values[1])


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
