"""The ``RAY_LIGHTNING_*`` environment variables; a setting read from an argument, else its variable, else a default."""

from __future__ import annotations

import math
import numbers
import os
import threading
from typing import Any

# Environment variables that set a strategy argument the user left out.
PLACEMENT_TIMEOUT_ENV = "RAY_LIGHTNING_PLACEMENT_TIMEOUT_S"
WORKER_START_TIMEOUT_ENV = "RAY_LIGHTNING_WORKER_START_TIMEOUT_S"
KEEP_WORKERS_ALIVE_ENV = "RAY_LIGHTNING_KEEP_WORKERS_ALIVE_S"
PROGRESS_TIMEOUT_ENV = "RAY_LIGHTNING_PROGRESS_TIMEOUT_S"
SCALE_UP_TIMEOUT_ENV = "RAY_LIGHTNING_SCALE_UP_TIMEOUT_S"
MAX_FAILURES_ENV = "RAY_LIGHTNING_MAX_FAILURES"
RECOVERY_EVERY_N_STEPS_ENV = "RAY_LIGHTNING_RECOVERY_CHECKPOINT_EVERY_N_STEPS"
STORAGE_PATH_ENV = "RAY_LIGHTNING_STORAGE_PATH"
RUN_NAME_ENV = "RAY_LIGHTNING_RUN_NAME"
UPLOAD_TIMEOUT_ENV = "RAY_LIGHTNING_UPLOAD_TIMEOUT_S"
DATA_TIMEOUT_ENV = "RAY_LIGHTNING_DATA_TIMEOUT_S"
NUM_WORKERS_ENV = "RAY_LIGHTNING_NUM_WORKERS"
BATCH_POLICY_ENV = "RAY_LIGHTNING_BATCH_POLICY"
GROW_CHECK_INTERVAL_ENV = "RAY_LIGHTNING_GROW_CHECK_INTERVAL_S"
SPARE_WORKERS_ENV = "RAY_LIGHTNING_SPARE_WORKERS"
# Variables of the driver that are not forwarded to the workers (launch.contexts forwards the others it
# names): they belong to the driver's process, such as the socket of its W&B service.
NOT_FORWARDED_ENV = ("WANDB_SERVICE",)
# What a variable says to switch a bound off.
OFF = ("none", "off", "")
# What an on/off variable may say.
SWITCH = {"1": True, "on": True, "true": True, "yes": True, "0": False, "off": False, "false": False, "no": False}
# The longest wait Python's threads (and so every bound here) accept: about 292 years.
MAX_SECONDS = threading.TIMEOUT_MAX


def seconds(name: str, value: Any, env: str, default: float, zero_ok: bool = False) -> float:
    """A time bound from the argument ``name``, else the variable ``env``, else ``default``."""
    source = name
    if value is None and env in os.environ:
        source, raw = f"{env} (environment variable)", os.environ[env]
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{source} must be a number of seconds, got {raw!r}.") from None
    elif value is None:
        value = default
    kind = "non-negative" if zero_ok else "positive"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{source} must be a {kind} number of seconds, got {value!r}.")
    if not math.isfinite(value) or value > MAX_SECONDS:
        raise ValueError(
            f"{source} must be a finite number of seconds (at most {MAX_SECONDS:.0f}), got {value!r}; "
            "for a very long bound give a large number such as 86400 (a day)."
        )
    if value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{source} must be a {kind} number of seconds, got {value!r}.")
    return float(value)


def switch(env: str, default: bool) -> bool:
    """On or off, from the variable ``env`` (``1``/``on``/``true``/``yes`` or ``0``/``off``/``false``/``no``), else
    ``default``."""
    raw = os.environ.get(env)
    if raw is None:
        return default
    said = raw.strip().lower()
    if said not in SWITCH:
        raise ValueError(f"{env} (environment variable) must be 0 or 1 (off or on), got {raw!r}.")
    return SWITCH[said]


def count(name: str, value: Any, env: str, default: int | None, minimum: int) -> int | None:
    """A whole number from the argument ``name``, else the variable ``env``, else ``default``."""
    source = name
    if value is None and env in os.environ:
        source, raw = f"{env} (environment variable)", os.environ[env]
        if raw.strip().lower() in OFF and default is None:
            return None
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{source} must be a whole number, got {raw!r}.") from None
    elif value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{source} must be a whole number >= {minimum}, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{source} must be >= {minimum}, got {value!r}.")
    return int(value)
