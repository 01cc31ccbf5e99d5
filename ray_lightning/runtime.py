"""What one worker knows during a call: its :class:`WorkerContext`, and the one place it is kept.

The launcher builds a :class:`WorkerContext` per worker (:mod:`ray_lightning.launch.contexts`);
the worker actor activates it for the length of the call (:func:`activated`). Code that must
behave differently inside a worker reads it with :func:`current_context` instead of module
globals of its own: the accelerator (train only where training belongs), the driver channel (where
rank 0 sends its calls), the strategy (ranks, devices). As Ray Train's ``get_context()`` does, this
answers None on the driver.

Each rank also says how far it got (:func:`mark_progress`: the phase it entered, a batch it
started...), which the launcher's watchdog reads to find a rank that is stuck; on the driver and
where no watchdog runs, marking is a no-op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

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
    # How often this rank sends its progress to the driver's watchdog; None: it sends none.
    progress_interval_s: float | None = None
    # Written to stdout and stderr when the call ends, so the driver knows all of its output
    # arrived (ray_lightning.channel.worker_output); None: the driver does not wait for it.
    output_marker: str | None = None
    # How many machines (distinct node IPs) the workers span; Ray nodes may share one.
    num_machines: int = 1


class ProgressMarker(Protocol):
    """Records this rank's progress (ray_lightning.channel.heartbeat.Heartbeat)."""

    def mark(self, phase: str, detail: str = "", startup: bool = False) -> None:
        """Entered ``phase`` (``detail``: where in it); ``startup`` phases are bounded by worker_start_timeout_s."""


_current: WorkerContext | None = None
_progress: ProgressMarker | None = None


def current_context() -> WorkerContext | None:
    """This worker's context while it runs a call; None on the driver and between calls."""
    return _current


def in_worker() -> bool:
    """True while this process runs a call as a ray_lightning worker."""
    return _current is not None


def mark_progress(phase: str, detail: str = "", startup: bool = False) -> None:
    """Tell the driver's watchdog this rank entered ``phase``; a no-op where none listens."""
    if _progress is not None:
        _progress.mark(phase, detail, startup)


@contextlib.contextmanager
def activated(context: WorkerContext, progress: ProgressMarker | None = None) -> Iterator[WorkerContext]:
    """Make ``context`` (and where its progress goes) this process's current one until the block ends."""
    global _current, _progress
    previous = _current, _progress
    _current, _progress = context, progress
    try:
        yield context
    finally:
        _current, _progress = previous
