"""What one worker knows during a call: its :class:`WorkerContext`, and the one place it is kept.

The launcher builds a :class:`WorkerContext` per worker (:mod:`ray_lightning.launch.contexts`);
the worker actor activates it for the length of the call (:func:`activated`). Code that must
behave differently inside a worker reads it with :func:`current_context` instead of module
globals of its own: the accelerator (train only where training belongs), the driver channel (where
rank 0 sends its calls), the strategy (ranks, devices). As Ray Train's ``get_context()`` does, this
answers None on the driver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ray_lightning.environment import WorkerRank


@dataclass(frozen=True)
class TorchFlags:
    """Process-wide torch settings ``Trainer(deterministic=..., benchmark=...)`` made on the driver."""

    deterministic: bool = False
    warn_only: bool = False
    cudnn_benchmark: bool = False

    @classmethod
    def capture(cls) -> TorchFlags:
        import torch

        return cls(
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.benchmark,
        )

    def apply(self) -> None:
        import torch

        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.warn_only)
        torch.backends.cudnn.benchmark = self.cudnn_benchmark


@dataclass(frozen=True)
class CheckpointFile:
    """The ``ckpt_path`` a call was given, when it is a file on the driver's machine.

    ``data`` is a reference to its bytes for workers on other machines (they write it locally
    before Lightning reads it), None for workers on the driver's machine (they read the path).
    """

    driver_path: str
    data: Any = None  # ray.ObjectRef | None


@dataclass(frozen=True)
class WorkerContext:
    """Everything a worker learns from the launcher before it runs a call."""

    rank: WorkerRank
    world_size: int
    num_nodes: int
    main_address: str
    main_port: int
    cuda_visible_devices: str
    device_index: int | None
    shares_gpu: bool
    # Rank 0 off the driver's machine writes its files under the staging directory of this name
    # and sends them back (ray_lightning.home.files); None elsewhere.
    staging_name: str | None
    env_vars: dict[str, str]
    driver_sys_path: tuple[str, ...] = ()
    torch_flags: TorchFlags = TorchFlags()
    # The queue of calls to run on the driver (ray_lightning.channel), if the Trainer needs one.
    driver_queue: Any = None
    checkpoint_file: CheckpointFile | None = None
    # How many machines (distinct node IPs) the workers span; Ray nodes may share one.
    num_machines: int = 1


_current: WorkerContext | None = None


def current_context() -> WorkerContext | None:
    """This worker's context while it runs a call; None on the driver and between calls."""
    return _current


def in_worker() -> bool:
    """True while this process runs a call as a ray_lightning worker."""
    return _current is not None


@contextlib.contextmanager
def activated(context: WorkerContext) -> Iterator[WorkerContext]:
    """Make ``context`` this process's current one until the block ends."""
    global _current
    previous, _current = _current, context
    try:
        yield context
    finally:
        _current = previous
