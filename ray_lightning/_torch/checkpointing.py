"""Activation checkpointing of a module's layers, with torch's private wrapper.

``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` is where torch keeps
``apply_activation_checkpointing`` (which wraps each matching submodule in place, the way FSDP2's
own examples and Lightning's FSDP strategy do); torch has no public home for it.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

CHECKPOINT_WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"


def apply_activation_checkpointing(module: nn.Module, check_fn: Callable[[nn.Module], bool]) -> None:
    """Wrap (in place) every submodule of ``module`` for which ``check_fn`` is true in torch's
    activation-checkpoint wrapper: its activations are recomputed in the backward pass, not kept."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as apply,
    )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    apply(module, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=check_fn)
