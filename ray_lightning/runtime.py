"""What one worker knows during a call: its :class:`WorkerContext`, and the one place it is kept.

The launcher builds a :class:`WorkerContext` per worker (:mod:`ray_lightning.launch.contexts`);
the worker actor activates it for the length of the call (:func:`activated`). Code that must
behave differently inside a worker reads it with :func:`current_context` instead of module
globals of its own: the accelerator (train only where training belongs), the driver channel (where
rank 0 sends its calls), the strategy (ranks, devices). As Ray Train's ``get_context()`` does, this
answers None on the driver.

A worker whose process or node is about to be taken away (SIGTERM, a node drained with a
deadline) asks rank 0 for a recovery checkpoint (:func:`request_checkpoint`); rank 0's recovery
callback takes it at the next batch end (:func:`take_checkpoint_request`).

Each rank also says how far it got (:func:`mark_progress`: the phase it entered, a batch it
started...), which the launcher's watchdog reads to find a rank that is stuck; on the driver and
where no watchdog runs, marking is a no-op.
"""

from __future__ import annotations

import contextlib
import threading
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
    data: Any = None  # ray.ObjectRef | None: the file's bytes, or a directory's {relative path: bytes}


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
    # and sends them back (ray_lightning.home.files); so does every rank off it of a sharded strategy
    # (its part of each checkpoint). None elsewhere.
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
    # The fit may restart its workers: rank 0 sends recovery checkpoints (None: it does not).
    recovery: RecoveryPlan | None = None
    # A sharded strategy's rank 0's staging directory name (when it stages), on every rank: the checkpoint
    # paths rank 0 broadcasts are turned back into the driver's (home.files.local_path).
    rank_zero_staging: str | None = None
    # The driver's niceness, which the worker's threads take during the call (launch.priority); None: Ray's.
    niceness: int | None = None
    # Checkpoints no rotation of ModelCheckpoint's may remove: the ckpt_path the call was given (Lightning#21813).
    keep_checkpoints: tuple[str, ...] = ()
    # Where a rank that stages copies its large files for the driver (``rlhome://``, home.outbox.Outbox); None: it
    # sends them as bytes (no rank stages).
    files_home: str | None = None


@dataclass(frozen=True)
class RecoveryPlan:
    """What a worker of a fit that may restart does for it (``ray_lightning.config.restarts.RecoverySettings``).

    ``every_n_steps``: rank 0 checkpoints every this many optimizer steps besides epoch ends.
    ``notice_key``: where any rank leaves word that its process or node is going away (Ray's
    internal key-value store), so rank 0 checkpoints at once. ``node_ids``: the nodes of this
    call's workers, whose draining rank 0 watches. ``seed``: files to put in rank 0's staging
    directory before training (what this fit wrote before a restart), a reference or None.
    ``attempt``: 0 for the call's first start, ``n`` after its ``n``-th restart. After a restart:
    ``log_step``, the loggers' step at the checkpoint resumed from (log rows from later steps are
    dropped: they are logged again), and ``random_states``, rank 0's random generators at the first
    step after it (None if unknown). ``storage_run``: with ``storage_path``, where the checkpoints go.
    ``from_memory``: every rank keeps its state when a peer's death fails a training batch, for a restart that
    goes on from there (``ray_lightning.home.snapshot``; replicated strategies: DDP, Horovod).
    """

    every_n_steps: int | None
    notice_key: str
    node_ids: tuple[str, ...] = ()
    seed: Any = None
    attempt: int = 0
    log_step: int | None = None
    random_states: Any = None
    # With storage_path: the run (ray_lightning.home.storage.Run) whose folder recovery checkpoints go to, written
    # by the ranks; None: rank 0 sends them to the driver.
    storage_run: Any = None
    # num_workers=(min, max): the sizes and the batch policy (ray_lightning.config.elastic); None: a fixed size.
    elastic: tuple[int, int, str] | None = None
    from_memory: bool = False


class ProgressMarker(Protocol):
    """Records this rank's progress (ray_lightning.channel.heartbeat.Heartbeat)."""

    def mark(self, phase: str, detail: str | tuple = "", startup: bool = False) -> None:
        """Entered ``phase`` (``detail``: where in it, or ``(template, *values)`` to format when sent);
        ``startup`` phases are bounded by worker_start_timeout_s."""


_current: WorkerContext | None = None
_progress: ProgressMarker | None = None
_checkpoint_request: list[str] = []  # the reasons given since rank 0 last checkpointed
_request_lock = threading.Lock()


def current_context() -> WorkerContext | None:
    """This worker's context while it runs a call; None on the driver and between calls."""
    return _current


def in_worker() -> bool:
    """True while this process runs a call as a ray_lightning worker."""
    return _current is not None


def mark_progress(phase: str, detail: str | tuple = "", startup: bool = False) -> None:
    """Tell the driver's watchdog this rank entered ``phase``; a no-op where none listens.

    ``detail`` says where in it: a string, or ``(template, *values)``, formatted only when it is sent
    (``("epoch {}, batch {}", epoch, batch)``: nothing is formatted per batch on the training thread)."""
    if _progress is not None:
        _progress.mark(phase, detail, startup)


def step_clock() -> Any:
    """This rank's ``ray_lightning.channel.timings.StepClock`` during a call (its heartbeat's), else None."""
    return getattr(_progress, "clock", None)


def request_checkpoint(reason: str) -> None:
    """Ask this process's recovery callback (rank 0's) for a checkpoint at the next batch end."""
    with _request_lock:
        _checkpoint_request.append(reason)


def take_checkpoint_request() -> str | None:
    """The reason a checkpoint was asked for since the last call (then forgotten), or None."""
    with _request_lock:
        if not _checkpoint_request:
            return None
        reason = "; ".join(dict.fromkeys(_checkpoint_request))
        _checkpoint_request.clear()
        return reason


@contextlib.contextmanager
def activated(context: WorkerContext, progress: ProgressMarker | None = None) -> Iterator[WorkerContext]:
    """Make ``context`` (and where its progress goes) this process's current one until the block ends."""
    global _current, _progress
    previous = _current, _progress
    _current, _progress = context, progress
    take_checkpoint_request()  # nothing asked during an earlier call carries over
    try:
        yield context
    finally:
        _current, _progress = previous
