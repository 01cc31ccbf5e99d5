"""Every private torch name ray_lightning uses, and nothing else.

torch's public API has no home for three things the strategies need; where none exists, the private
name is touched here and only here, so that a torch release that moves one breaks one folder, and
``tests/test_torch_internals.py`` names what moved:

* :mod:`.checkpointing`: ``apply_activation_checkpointing`` and ``checkpoint_wrapper`` of
  ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``, for ``RayFSDPStrategy``'s
  activation checkpointing (:mod:`ray_lightning.strategies.fsdp`), behind
  :func:`apply_activation_checkpointing`.
* :mod:`.optim`: the markers an LR scheduler leaves on its optimizer (``step._wrapped_by_lr_sched``,
  ``_opt_called``), set on the Horovod optimizer a scheduler is re-pointed at
  (:mod:`ray_lightning.horovod.optim`), behind :func:`count_steps_for_schedulers`.
* :mod:`.ddp`: ``DistributedDataParallel._get_ddp_logging_data``, the reducer's own sampled timings, for the
  wait for the gradient all-reduce in each rank's step times (:mod:`ray_lightning.channel.timings`), behind
  :func:`allreduce_wait_probe`.

:data:`PRIVATE_NAMES` lists all of them; a test checks each still exists. :class:`PrivateName`, the
record of one, is shared with the other fences (:mod:`ray_lightning._ray`,
:mod:`ray_lightning._lightning`), which are layered above this one.
"""

from ray_lightning._torch.checkpointing import apply_activation_checkpointing
from ray_lightning._torch.ddp import allreduce_wait_probe
from ray_lightning._torch.names import PRIVATE_NAMES
from ray_lightning._torch.optim import count_steps_for_schedulers
from ray_lightning._torch.private import PrivateName

__all__ = [
    "PRIVATE_NAMES",
    "PrivateName",
    "allreduce_wait_probe",
    "apply_activation_checkpointing",
    "count_steps_for_schedulers",
]
