"""Every private torch name of this folder, with where torch keeps it (:data:`PRIVATE_NAMES`).

``tests/test_torch_internals.py`` checks each still exists and names any that moved.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ray_lightning._torch.checkpointing import CHECKPOINT_WRAPPER
from ray_lightning._torch.ddp import LOGGING_DATA
from ray_lightning._torch.optim import CALLED_MARK, STEP_MARK
from ray_lightning._torch.private import PrivateName

SCHEDULER = "torch.optim.lr_scheduler.LRScheduler"
DDP = "torch.nn.parallel.DistributedDataParallel"


def _module(path: str) -> Callable[[], Any]:
    return lambda: importlib.import_module(path)


def _scheduled_optimizer(stepped: bool) -> Callable[[], Any]:
    """An optimizer as an LR scheduler leaves it once created (and, ``stepped``, after one step)."""

    def make() -> Any:
        import torch

        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        if stepped:
            optimizer.step()
        return optimizer

    return make


PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName(CHECKPOINT_WRAPPER, "apply_activation_checkpointing", _module(CHECKPOINT_WRAPPER)),
    PrivateName(CHECKPOINT_WRAPPER, "checkpoint_wrapper", _module(CHECKPOINT_WRAPPER)),
    PrivateName(f"an optimizer's step wrapped by {SCHEDULER}", f"step.{STEP_MARK}", _scheduled_optimizer(False)),
    PrivateName(f"an optimizer stepped after {SCHEDULER} wrapped it", CALLED_MARK, _scheduled_optimizer(True)),
    PrivateName(DDP, LOGGING_DATA, lambda: importlib.import_module("torch.nn.parallel").DistributedDataParallel),
)
