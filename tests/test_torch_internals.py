"""Every private torch name ray_lightning relies on still exists, and still does what we use it for.

The names live in ray_lightning._torch (the one folder allowed to use them, tests/test_layers.py);
when a torch release moves one, this is the test that says which, and where it used to be.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ray_lightning import _torch
from ray_lightning._torch import PRIVATE_NAMES

MOVED = (
    "torch moved a private name ray_lightning relies on: {}. "
    "Update ray_lightning/_torch/ (the only place that uses it)."
)


@pytest.mark.parametrize("private", PRIVATE_NAMES, ids=lambda p: f"{p.where}.{p.name}")
def test_private_torch_name_still_exists(private):
    missing = private.missing()
    assert missing is None, MOVED.format(missing)


def test_a_moved_name_is_reported(monkeypatch):
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper

    monkeypatch.delattr(checkpoint_wrapper, "apply_activation_checkpointing")
    entry = next(p for p in PRIVATE_NAMES if p.name == "apply_activation_checkpointing")
    assert entry.missing() == (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper has no apply_activation_checkpointing "
        "(no 'apply_activation_checkpointing' on module)"
    )


def test_a_scheduler_moved_to_a_counted_optimizer_does_not_warn():
    """What Horovod's optimizer gets: torch's check that the optimizer stepped first still reads our markers."""
    weight = nn.Parameter(torch.zeros(1))
    scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([weight], lr=0.1), step_size=1)
    other = torch.optim.SGD([weight], lr=0.1)  # not wrapped by any scheduler
    scheduler.optimizer = other
    _torch.count_steps_for_schedulers(other)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        weight.grad = torch.ones(1)
        other.step()
        scheduler.step()
    assert other.param_groups[0]["lr"] == pytest.approx(0.01)


def test_activation_checkpointing_wraps_the_chosen_layers():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    _torch.apply_activation_checkpointing(model, check_fn=lambda layer: isinstance(layer, nn.Linear))
    wrapped = [type(layer).__name__ for layer in model]
    assert wrapped == ["CheckpointWrapper", "ReLU", "CheckpointWrapper"], wrapped
    model(torch.ones(3, 2)).sum().backward()  # recomputed in the backward pass, same gradients
    assert all(p.grad is not None for p in model.parameters())
