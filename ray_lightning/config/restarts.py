"""How a fit survives lost workers: ``max_failures`` and the recovery checkpoints' cadence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray_lightning.config.variables import (
    MAX_FAILURES_ENV,
    RECOVERY_EVERY_N_STEPS_ENV,
    SPARE_WORKERS_ENV,
    count,
    switch,
)


@dataclass(frozen=True)
class RecoverySettings:
    """How a fit survives lost workers.

    ``max_failures``: how many times the worker group may be restarted from the latest recovery
    checkpoint within one call (0: a failure ends the call, as before). ``every_n_steps``: rank 0
    also takes a recovery checkpoint every this many optimizer steps, besides every epoch end
    (None: epoch ends only). Recovery checkpoints are taken only when ``max_failures > 0``.
    ``spare_workers``: with ``max_failures > 0``, each node of the fit keeps a spare worker process that takes a
    dead worker's place (:mod:`ray_lightning.launch.worker_group`); ``RAY_LIGHTNING_SPARE_WORKERS=0`` turns it off.
    """

    max_failures: int = 0
    every_n_steps: int | None = None
    spare_workers: bool = True

    @property
    def enabled(self) -> bool:
        return self.max_failures > 0

    @classmethod
    def resolve(cls, max_failures: Any = None, every_n_steps: Any = None) -> RecoverySettings:
        """Arguments left as None come from ``RAY_LIGHTNING_MAX_FAILURES`` and
        ``RAY_LIGHTNING_RECOVERY_CHECKPOINT_EVERY_N_STEPS``, else 0 and None; ``spare_workers`` from
        ``RAY_LIGHTNING_SPARE_WORKERS`` (0 or 1, default 1)."""
        return cls(
            count("max_failures", max_failures, MAX_FAILURES_ENV, 0, 0) or 0,
            count("recovery_checkpoint_every_n_steps", every_n_steps, RECOVERY_EVERY_N_STEPS_ENV, None, 1),
            switch(SPARE_WORKERS_ENV, True),
        )
