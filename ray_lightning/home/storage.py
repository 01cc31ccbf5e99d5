"""A run's files in storage (``storage_path``): written by the ranks themselves, never through the driver.

With ``storage_path`` the run's folder is ``<storage_path>/<run_name>`` (:class:`Run`), an fsspec URL
or a directory every node mounts. The driver places the Trainer's directories there before the
launch (:func:`open_run`), checks that it can write there (a bad path fails before any worker
starts), and afterwards reads only small files: the markers of complete recovery checkpoints.

* **Recovery checkpoints** go to ``<run>/recovery/step=<global step>-<id>/``: a full checkpoint file
  written by rank 0 (DDP, Horovod), or torch's distributed checkpoint with each rank writing its
  shard (the sharded strategies). A marker, :data:`MARKER`, is written last, when every rank's part
  is there; only a marked checkpoint is resumed from (:func:`newest_complete`): by a restart, and by
  the same script run again with the same ``run_name`` after its driver died.
* **Uploads run beside training** (:class:`Uploads`): a checkpoint's tensors are copied in memory on the
  training thread (:func:`snapshot`; a shard is staged by torch's ``async_save``), then serialized and written
  by one background thread; the next save
  waits if the last is still being written, so at most one is in flight per rank. A failed upload
  is raised at the next save or before ``fit`` returns, naming the path (:class:`~ray_lightning.errors.StorageError`).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import posixpath
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import fsspec

from ray_lightning import _lightning, runtime
from ray_lightning.config.storage import StorageSettings, is_local
from ray_lightning.config.variables import UPLOAD_TIMEOUT_ENV, seconds
from ray_lightning.errors import StorageError
from ray_lightning.home import files

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)

# The driver's recovery folder without storage_path (home.driver_disk), in every process that reads or writes it.
fsspec.register_implementation("rlhome", "ray_lightning.home.driver_disk.DriverDiskFileSystem", clobber=True)

RECOVERY = "recovery"
MARKER = "COMPLETE.json"  # written last: every rank's part of the checkpoint is in its folder
_MARKER_FIELDS = {"epoch", "global_step", "log_step", "reason", "resume_from", "written_at", "folder"}
CHECKPOINT_FILE = "checkpoint.ckpt"  # a full (DDP) recovery checkpoint in its folder
# How often a rank waiting for an upload says it still waits (the hang watchdog counts it as progress), and the
# longest it waits (a checkpoint of tens of GB on a slow link takes minutes, not hours).
_WAIT_REPORT_S = 10.0
DEFAULT_UPLOAD_TIMEOUT_S = 7200.0
_WRITE_SLICE_BYTES = 8 * 2**20
# How long a failed call's rank lets its upload in flight finish: under the 5 s the launcher waits for the ranks that
# survived a peer's death to come out of their call (launch.launcher.SALVAGE_WAIT_S), so a surviving rank 0 is never
# replaced while its checkpoint may still complete after the driver looked for the newest one.
ABANDON_WAIT_S = 4.0


@dataclass(frozen=True)
class Run:
    """Where one run's files go: ``url`` is ``<storage_path>/<name>``, ``root`` the storage path."""

    url: str
    name: str
    root: str = ""

    def holds(self, path: str) -> bool:
        """Whether ``path`` is in the storage path (this run's folder or another's): every worker reads it there."""
        root = self.root or self.url
        return path == root or path.startswith(root.rstrip("/" + os.sep) + ("/" if not is_local(root) else os.sep))

    def recovery_folder(self, global_step: int, tag: str) -> str:
        """The folder of a recovery checkpoint taken after ``global_step`` optimizer steps; ``tag`` (the same on every
        rank) makes it unique to the call, the attempt and the checkpoint."""
        return join(self.url, RECOVERY, f"step={global_step:09d}-{tag}")


@dataclass(frozen=True)
class RecoveryEntry:
    """A complete recovery checkpoint in storage: its folder, what ``ckpt_path`` resumes from, what its marker says."""

    folder: str
    resume_from: str
    header: dict[str, Any]


def open_run(trainer: pl.Trainer | None, settings: StorageSettings, run_name: Callable[[], str]) -> Run | None:
    """On the driver, before a call is launched: the run's folder (None: no storage), checked writable, and the
    Trainer's directories placed in it (:func:`~ray_lightning.home.files.place_in`).

    ``Trainer(default_root_dir="s3://...")`` without ``storage_path`` makes that URL the storage path.
    ``run_name`` is called only when storage is used.
    """
    root = getattr(trainer, "default_root_dir", None) if trainer is not None else None
    if not settings.enabled and isinstance(root, str) and not _lightning.is_local_file_protocol(root):
        settings = settings.with_path(root)
    if settings.path is None:
        return None
    forget_cached_filesystems()
    name = run_name()
    run = Run(join(settings.path, name), name, settings.path)
    check_writable(run.url)
    if trainer is not None:
        files.make_absolute(trainer)
        files.place_in(trainer, settings.path, lambda *parts: join(run.url, *parts))
        _lightning.use_filesystems_of_paths(trainer)
    return run


def join(base: str, *parts: str) -> str:
    """``base`` joined with ``parts``: with ``/`` for URLs, as the OS joins for paths."""
    return os.path.join(base, *parts) if is_local(base) else posixpath.join(base, *parts)


def filesystem(url: str) -> tuple[Any, str]:
    """``(fsspec filesystem, path in it)`` for ``url``."""
    import fsspec

    return fsspec.core.url_to_fs(url)


def forget_cached_filesystems() -> None:
    """Drop fsspec's cached filesystem objects: credentials and endpoints come from this call's environment.

    A worker runs many calls; an S3 filesystem made in an earlier one would keep that call's endpoint.
    """
    import fsspec

    for implementation in list(fsspec.registry.values()):
        with contextlib.suppress(Exception):
            implementation.clear_instance_cache()


def check_writable(url: str) -> None:
    """On the driver, before any worker starts: write and remove a small file in ``url``, or raise naming why."""
    probe = join(url, f".ray_lightning-write-check-{uuid.uuid4().hex[:8]}")
    try:
        fs, path = filesystem(probe)
        if is_local(url):
            os.makedirs(url, exist_ok=True)
        fs.pipe_file(path, b"ray_lightning checks that this run can write here\n")
        fs.rm_file(path)
    except Exception as error:  # any failure means the run cannot keep its files there
        raise StorageError(
            f"ray_lightning: cannot write the run's files to {url} (storage_path / run_name): "
            f"{type(error).__name__}: {error}. Check the path, the bucket and the credentials in this "
            "environment (the workers get the same AWS_*, GOOGLE_*, AZURE_* variables)."
        ) from error


def write_bytes(url: str, data: bytes | memoryview) -> None:
    """Write ``data`` at ``url``; a local file appears whole (written beside, then renamed)."""
    view = memoryview(data)

    def write(f: Any) -> None:
        # In slices: a filesystem's file buffers what it is given before it sends a part (s3fs, rlhome://), so one
        # write of the whole would hold a second copy of it.
        for start in range(0, len(view), _WRITE_SLICE_BYTES):
            f.write(view[start : start + _WRITE_SLICE_BYTES])

    _write(url, write)


def save_checkpoint(url: str, checkpoint: dict[str, Any]) -> None:
    """``torch.save`` of ``checkpoint`` streamed to ``url`` as it is serialized: no serialized copy in memory (the
    largest tensor and a filesystem's part at most); a local file appears whole (written beside, then renamed)."""
    import torch

    _write(url, lambda f: torch.save(checkpoint, f))


def _write(url: str, write: Callable[[Any], None]) -> None:
    """``write(file)`` into the file at ``url``: a local one beside its name, renamed when complete."""
    fs, path = filesystem(url)
    if not is_local(url):
        with fs.open(path, "wb") as f:
            write(f)
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = f"{path}.partial-{uuid.uuid4().hex[:8]}"
    with open(partial, "wb") as f:
        write(f)
    os.replace(partial, path)


def remove(url: str) -> None:
    """Remove the file or folder at ``url`` (gone already: nothing to do)."""
    fs, path = filesystem(url)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(path, recursive=True)


def write_marker(folder: str, header: dict[str, Any]) -> None:
    write_bytes(join(folder, MARKER), json.dumps(header, sort_keys=True).encode())


def newest_complete(run: Run) -> RecoveryEntry | None:
    """The recovery checkpoint with the most steps whose marker was written, or None: read on the driver."""
    fs, root = filesystem(join(run.url, RECOVERY))
    fs.invalidate_cache()  # an object store's listing is cached: the ranks wrote since
    try:
        folders = fs.ls(root, detail=False)
    except FileNotFoundError:
        return None
    best: RecoveryEntry | None = None
    for folder in folders:
        try:
            header = json.loads(fs.cat_file(posixpath.join(folder, MARKER)))
        except (FileNotFoundError, ValueError, OSError):
            continue  # half-written: never resumed from
        if not isinstance(header, dict) or not _MARKER_FIELDS <= set(header):
            continue  # not a marker of ours
        name = posixpath.basename(folder.rstrip("/"))
        entry = RecoveryEntry(join(run.url, RECOVERY, name), header["resume_from"], header)
        if best is None or (header["global_step"], header["written_at"]) > (
            best.header["global_step"],
            best.header["written_at"],
        ):
            best = entry
    return best


def remove_older_recovery(run: Run, keep: str) -> None:
    """In rank 0, after ``keep`` is complete: remove the run's other recovery checkpoints (this run wrote them)."""
    fs, root = filesystem(join(run.url, RECOVERY))
    fs.invalidate_cache()
    with contextlib.suppress(FileNotFoundError):
        for folder in fs.ls(root, detail=False):
            name = posixpath.basename(folder.rstrip("/"))
            if join(run.url, RECOVERY, name) != keep:
                with contextlib.suppress(FileNotFoundError):
                    fs.rm(folder, recursive=True)


def snapshot(value: Any) -> Any:
    """``value`` (a checkpoint) with every tensor copied to CPU memory: what training does next changes none of it.

    Copying is what the training thread pays for a checkpoint; serializing and writing the copy run beside it.
    """
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        copied = {k: snapshot(v) for k, v in value.items()}
        return copied if type(value) is dict else type(value)(copied)  # an OrderedDict stays one
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(snapshot(v) for v in value)
    return value


def serialize(checkpoint: dict[str, Any]) -> memoryview:
    """A checkpoint as ``torch.save`` writes it, in memory: what an upload then writes."""
    import torch

    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.getbuffer()


class Uploads:
    """This process's checkpoint uploads, beside training, in the order given (see the module docstring).

    One background thread runs the jobs in order. A save (:meth:`submit`) first waits for every job before it:
    at most one upload is in flight. A removal (:meth:`run_in_order`) joins the queue without waiting. After a
    failed call, :meth:`abandon` tells the jobs still queued or running that their call is over.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[str, Callable[[], None]] | None] = queue.Queue()
        self._idle = threading.Condition()
        self._pending: list[str] = []  # what the queued and running jobs write, oldest first
        self._failed: tuple[str, BaseException] | None = None
        self._thread: threading.Thread | None = None
        self.abandoned = False  # the call is over: a job writes no marker and removes nothing any more
        self.blocked_s = 0.0  # time the training thread spent waiting for an upload to end

    def submit(self, what: str, start: Callable[[], Callable[[], None]]) -> None:
        """After every job before it ended: ``start()`` on this thread (it snapshots the checkpoint and returns the
        job), then the job in the background. ``what`` names the path in an error."""
        self.wait()
        self._enqueue(what, start())

    def run_in_order(self, what: str, job: Callable[[], None]) -> None:
        """``job`` in the background after the jobs before it (removing a checkpoint that may still be uploading);
        the caller does not wait."""
        self._raise_failure()
        self._enqueue(what, job)

    def _enqueue(self, what: str, job: Callable[[], None]) -> None:
        with self._idle:
            self._pending.append(what)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="ray_lightning-upload", daemon=True)
            self._thread.start()
        self._jobs.put((what, job))

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            what, job = item
            try:
                job()
            except BaseException as error:  # noqa: BLE001 - raised on the training thread (wait)
                with self._idle:
                    self._failed = self._failed or (what, error)
            # The job holds the checkpoint's copy: let it go now, not when the next job arrives (the next save's
            # copy would be taken while this one is still held, two copies of the state at once).
            del item, job
            with self._idle:
                self._pending.remove(what)
                self._idle.notify_all()

    def wait(self, timeout_s: float | None = None) -> None:
        """Until every job ended (bounded by ``RAY_LIGHTNING_UPLOAD_TIMEOUT_S``); a failure is raised here, naming
        the path. While it waits the rank reports progress: a big upload is not a hang."""
        bound = upload_timeout_s() if timeout_s is None else timeout_s
        started = time.perf_counter()
        with self._idle:
            while self._pending:
                waited = time.perf_counter() - started
                if waited > bound:
                    raise StorageError(
                        f"ray_lightning: the upload of {self._pending[0]} did not end within {bound:g} s "
                        f"({UPLOAD_TIMEOUT_ENV}); is the storage reachable from this node?"
                    )
                runtime.mark_progress("training", f"waiting for the upload of {self._pending[0]}")
                self._idle.wait(min(_WAIT_REPORT_S, bound - waited + 0.01))
        self.blocked_s += time.perf_counter() - started
        self._raise_failure()

    def _raise_failure(self) -> None:
        with self._idle:
            failed, self._failed = self._failed, None
        if failed is not None:
            what, error = failed
            raise StorageError(
                f"ray_lightning: writing {what} to storage failed: {type(error).__name__}: {error}"
            ) from error

    def abandon(self, timeout_s: float = ABANDON_WAIT_S) -> None:
        """After a failed call, before the call returns: the jobs in flight may end within ``timeout_s`` (a
        checkpoint a surviving rank 0 was writing when a peer died completes, and the restart resumes from it:
        the driver looks for the newest complete one once the survivors' calls returned); jobs still left then
        write no marker and remove nothing (a restart may be reading the checkpoint they would replace)."""
        with self._idle:
            self._idle.wait_for(lambda: not self._pending, timeout_s)
        self.abandoned = True
        self._jobs.put(None)

    def close(self) -> None:
        """After a call that succeeded (every job ended): the thread ends."""
        self._jobs.put(None)


def upload_timeout_s() -> float:
    """How long a rank waits for an upload in flight: ``RAY_LIGHTNING_UPLOAD_TIMEOUT_S``, else 2 hours."""
    return seconds("upload wait", None, UPLOAD_TIMEOUT_ENV, DEFAULT_UPLOAD_TIMEOUT_S)


_UPLOADS = Uploads()


def uploads() -> Uploads:
    """This process's uploads."""
    return _UPLOADS


def reset_uploads() -> None:
    """At the start of a call in a worker: no upload of an earlier call is waited for or raised."""
    global _UPLOADS
    _UPLOADS.close()
    _UPLOADS = Uploads()
