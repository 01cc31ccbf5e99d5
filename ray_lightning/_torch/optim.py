"""The markers torch's LR schedulers put on their optimizer, set on an optimizer they did not wrap.

An ``LRScheduler`` wraps its optimizer's ``step`` when it is created: the wrapper is marked
``_wrapped_by_lr_sched`` and sets ``optimizer._opt_called`` on each call, and ``scheduler.step()``
warns ("Detected call of `lr_scheduler.step()` before `optimizer.step()`") unless both are there.
A scheduler pointed at another optimizer afterwards (Horovod's, which replaces the one it was built
with) must find the same markers there; torch has no public way to ask for them.
"""

from __future__ import annotations

import functools
from typing import Any

from torch.optim import Optimizer

STEP_MARK = "_wrapped_by_lr_sched"  # on the wrapped optimizer.step
CALLED_MARK = "_opt_called"  # on the optimizer, set by each call of its wrapped step


def count_steps_for_schedulers(optimizer: Optimizer) -> None:
    """Wrap ``optimizer.step`` as an LR scheduler created with it would: its calls are seen by the scheduler."""
    step = optimizer.step

    @functools.wraps(step)
    def counted_step(*args: Any, **kwargs: Any) -> Any:
        setattr(optimizer, CALLED_MARK, True)
        return step(*args, **kwargs)

    setattr(counted_step, STEP_MARK, True)
    optimizer.step = counted_step  # type: ignore[method-assign]
