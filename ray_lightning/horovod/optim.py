"""Helpers for Horovod's collectives and optimizer inside Lightning's loops."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from ray_lightning import _torch


def writable(tensor: Tensor) -> Tensor:
    # Horovod fills its outputs from its background thread, which is outside Lightning's
    # torch.inference_mode, where inference tensors cannot be written: hand it normal tensors.
    return tensor.clone() if tensor.is_inference() else tensor


def horovod_op(hvd: Any, reduce_op: Any) -> Any:
    name = getattr(reduce_op, "name", reduce_op)  # torch's ReduceOp.SUM, or a string
    name = "mean" if name is None else str(name).lower()
    ops = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}
    if name not in ops:
        raise ValueError(f"HorovodRayStrategy cannot reduce with {reduce_op!r}; use one of {sorted(ops)}.")
    return ops[name]


def retarget_scheduler(scheduler: Any, optimizer: Optimizer) -> None:
    """Point an LR scheduler at the Horovod optimizer that replaced the one it was built with.

    Both share the same ``param_groups``, so the rates the scheduler sets already reach the new
    optimizer; re-pointing keeps torch's "scheduler stepped before optimizer" check (which
    watches ``optimizer.step``) from warning on every run.
    """
    scheduler.optimizer = optimizer
    _torch.count_steps_for_schedulers(optimizer)
