"""The time bounds of a launch: arguments, else ``RAY_LIGHTNING_*`` variables, else these defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ray_lightning.config.variables import (
    KEEP_WORKERS_ALIVE_ENV,
    OFF,
    PLACEMENT_TIMEOUT_ENV,
    PROGRESS_TIMEOUT_ENV,
    SCALE_UP_TIMEOUT_ENV,
    WORKER_START_TIMEOUT_ENV,
    seconds,
)

DEFAULT_PLACEMENT_TIMEOUT_S = 60.0
# 15 minutes: a cloud node (a spot GPU instance) takes minutes to boot, pull its image and join;
# the autoscaler retries a launch that failed within that time.
DEFAULT_SCALE_UP_TIMEOUT_S = 900.0
DEFAULT_WORKER_START_TIMEOUT_S = 300.0
DEFAULT_KEEP_WORKERS_ALIVE_S = 60.0

# 15 minutes: longer than any one batch or evaluation step of a real workload, shorter than the
# 30 minutes after which torch.distributed's own timeout fails with an error that blames rank 0.
# Long prepare_data() downloads or setup() need more; None switches the watchdog off. Since None
# already means "off", the argument's default is this value, and RAY_LIGHTNING_PROGRESS_TIMEOUT_S
# applies whenever the argument equals it, given or left out: LightningCLI passes every argument
# with its default, read back from YAML, and a value cannot tell how it arrived. A plain float, so
# LightningCLI's --print_config can write it.
DEFAULT_PROGRESS_TIMEOUT_S = 900.0


def _progressseconds(value: float | None) -> float | None:
    if value == DEFAULT_PROGRESS_TIMEOUT_S:
        text = os.environ.get(PROGRESS_TIMEOUT_ENV)
        if text is None:
            return float(value)
        try:
            value = None if text.strip().lower() in OFF else float(text)
        except ValueError:
            raise ValueError(
                f"{PROGRESS_TIMEOUT_ENV}={text!r}: give a positive number of seconds, or 'none' to switch "
                "the progress watchdog off."
            ) from None
    return None if value is None else seconds("progress_timeout_s", value, PROGRESS_TIMEOUT_ENV, 0.0)


@dataclass(frozen=True)
class WorkerTimeouts:
    """The time bounds of a launch, in seconds.

    ``placement_s``: waiting for the cluster to free the resources; ``start_s``: started workers
    reporting in and meeting, ``init_hook`` included; ``keep_alive_s``: workers waiting for the
    next call (0: never); ``progress_s``: a rank without progress in setup or any loop (None: no bound).
    """

    placement_s: float
    start_s: float
    keep_alive_s: float
    progress_s: float | None = None
    # Waiting for the autoscaler to start nodes that a request needs (only when it can).
    scale_up_s: float = DEFAULT_SCALE_UP_TIMEOUT_S

    @classmethod
    def resolve(
        cls,
        placement_timeout_s: float | None,
        worker_start_timeout_s: float | None,
        keep_workers_alive_s: float | None,
        progress_timeout_s: float | None = DEFAULT_PROGRESS_TIMEOUT_S,
        scale_up_timeout_s: float | None = None,
    ) -> WorkerTimeouts:
        """Arguments left as None (``progress_timeout_s``: left out) come from the ``RAY_LIGHTNING_*``
        variables, else the defaults; ``progress_timeout_s=None`` switches that bound off."""
        return cls(
            seconds("placement_timeout_s", placement_timeout_s, PLACEMENT_TIMEOUT_ENV, DEFAULT_PLACEMENT_TIMEOUT_S),
            seconds(
                "worker_start_timeout_s",
                worker_start_timeout_s,
                WORKER_START_TIMEOUT_ENV,
                DEFAULT_WORKER_START_TIMEOUT_S,
            ),
            seconds(
                "keep_workers_alive_s",
                keep_workers_alive_s,
                KEEP_WORKERS_ALIVE_ENV,
                DEFAULT_KEEP_WORKERS_ALIVE_S,
                zero_ok=True,
            ),
            _progressseconds(progress_timeout_s),
            seconds("scale_up_timeout_s", scale_up_timeout_s, SCALE_UP_TIMEOUT_ENV, DEFAULT_SCALE_UP_TIMEOUT_S),
        )
