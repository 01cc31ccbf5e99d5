"""Files rank 0 writes (checkpoints, CSV/TensorBoard logs) end up on the driver's machine.

When rank 0 runs on another machine than the process that called ``fit`` (another node, or any
node when the driver is a Ray Client), the paths the driver chose may not exist or be writable
there (``/Users/alice/project`` on a Linux node). So rank 0 writes everything under a staging
directory instead (``<tmp>/<name the launcher chose>``): each local absolute path ``P`` the
Trainer would write under becomes ``<staging>/P``. When the call ends, every file in the staging
directory comes home and is written at its original path on the driver: a small file with the results,
a large one (:data:`~.outbox.INLINE_BYTES` or more) copied by the rank into the driver's folder in chunks
(:mod:`.driver_disk`) and moved into place there, so no process holds it whole. If the call
fails, the launcher fetches them from rank 0's node (:func:`fetch_after_failure`), so a crash
loses no checkpoint. The checkpoint callbacks' state, in the ``.ckpt`` files and sent back, holds
the driver's paths. The staging directory is private to its user (0700), and the driver writes a
file only where its Trainer writes (:class:`~.landing.WriteScope`).

The directory attributes rewritten here are Lightning's (:func:`ray_lightning._lightning.directory_holders`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from ray_lightning import _lightning, namespaces
from ray_lightning.home.landing import WriteScope, resolved, write
from ray_lightning.home.outbox import Outbox, SentFile, received

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagingArea:
    """Where rank 0, off the driver's machine, writes its files during a call: directory ``name`` on ``node_id``."""

    node_id: str
    name: str

    @classmethod
    def new(cls, node_id: str) -> StagingArea:
        return cls(node_id, new_staging_name())


def new_staging_name() -> str:
    """A staging directory's name, unique to the call."""
    return f"ray_lightning-staging-{uuid.uuid4().hex[:12]}"


def _map_paths(trainer: pl.Trainer, mapping: Callable[[str], str]) -> None:
    _map_holders(_lightning.directory_holders(trainer), mapping)


def map_logger_paths(loggers: Iterable[Any], mapping: Callable[[str], str]) -> None:
    """Apply ``mapping`` to the local directories ``loggers`` (Fabric's) write under."""
    _map_holders(_lightning.logger_directory_holders(loggers), mapping)


def _map_holders(holders: Iterable[tuple[Any, tuple[str, ...]]], mapping: Callable[[str], str]) -> None:
    for holder, attributes in holders:
        for name in attributes:
            value = getattr(holder, name, None)
            if isinstance(value, (str, os.PathLike)) and _lightning.is_local_file_protocol(value) and os.fspath(value):
                setattr(holder, name, mapping(os.fspath(value)))
        if isinstance(holder, namespaces.every("callbacks.ModelCheckpoint")):
            holder.best_k_models = {mapping(str(k)): v for k, v in holder.best_k_models.items()}


def make_absolute(trainer: pl.Trainer) -> None:
    """On the driver, before launching: resolve relative directories against the driver's working directory.

    Workers elsewhere have another working directory; the driver's meaning of ``"logs/"`` wins.
    """
    _map_paths(trainer, lambda p: os.path.abspath(os.path.expanduser(p)))


def place_in(trainer: pl.Trainer, storage: str, under: Callable[..., str]) -> None:
    """On the driver, with ``storage_path``: the Trainer's local directories move into the run's folder, ``under(...)``.

    A directory under ``default_root_dir`` keeps its place relative to it (``<run>/lightning_logs/version_0``);
    another absolute path keeps its whole path under the run's folder. URLs the user gave, and paths already in
    the storage path ``storage`` (a mounted directory), stay as they are.
    """

    def stored(path: str) -> bool:
        return path == storage or path.startswith(storage.rstrip(os.sep) + os.sep)

    root = trainer.default_root_dir
    root = os.path.abspath(root) if _lightning.is_local_file_protocol(root) and not stored(root) else None

    def moved(path: str) -> str:
        if stored(path):
            return path  # already in storage (an earlier call placed it, or the user chose it)
        if root is not None and (path == root or path.startswith(root.rstrip(os.sep) + os.sep)):
            relative = os.path.relpath(path, root)
            return under() if relative == "." else under(*relative.split(os.sep))
        return under(*os.path.splitdrive(path)[1].strip("/\\").split(os.sep))

    _map_paths(trainer, lambda p: moved(p) if os.path.isabs(p) else p)


def path_forms(path: Any) -> tuple[str, ...]:
    """The forms a checkpoint path given by the user may take in a worker's comparison: as given, and absolute
    when local (nothing for a ``ckpt_path`` that is no path)."""
    if not isinstance(path, (str, os.PathLike)):
        return ()
    path = os.fspath(path)
    return (path, os.path.abspath(path)) if _lightning.is_local_file_protocol(path) else (path,)


def staging_dir(name: str) -> str:
    """The staging directory called ``name`` on this node."""
    return os.path.join(tempfile.gettempdir(), name)


def make_private_dir(path: str) -> None:
    """Create directory ``path`` that only this user can enter (mode 0700).

    An existing one is used only if it is a directory of this user's that no one else can enter
    (in a shared temporary directory, someone else may have made it first).
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise PermissionError(
                f"ray_lightning's staging directory {path} already exists and is not a private directory of "
                f"this user (mode {stat.filemode(info.st_mode)}, owner uid {info.st_uid}); refusing to write into it."
            ) from None
    os.chmod(path, 0o700)  # the umask may have taken bits away; none are added


def stage(trainer: pl.Trainer, staging: str) -> None:
    """In rank 0 off the driver's machine: write under ``staging`` instead of the driver's paths.

    ``staging`` is created private to this user (0700): checkpoints and logs are the user's data.
    """
    make_private_dir(staging)
    _map_paths(trainer, lambda p: to_staged(p, staging) if os.path.isabs(p) else p)
    for callback in trainer.callbacks:
        if isinstance(callback, namespaces.every("callbacks.ModelCheckpoint")):
            _translate_state(callback, staging)


def _translate_state(callback: Any, staging: str) -> None:
    """The callback's state speaks of the driver's paths: in checkpoints, on resume, sent back."""
    state_dict, load_state_dict = callback.state_dict, callback.load_state_dict

    def driver_state() -> dict[str, Any]:
        return from_staged(state_dict(), staging)

    def load_driver_state(state: dict[str, Any]) -> None:
        load_state_dict(_staged_value(state, staging))

    callback.state_dict = driver_state  # type: ignore[method-assign]
    callback.load_state_dict = load_driver_state  # type: ignore[method-assign]


def local_path(path: str, rank_zero_staging: str | None, own_staging: str | None) -> str:
    """Where this rank writes its part of a checkpoint whose path rank 0 chose (and broadcast).

    The path is turned back into the driver's (rank 0 may stage), then into this rank's staging
    directory if it stages: every rank's part comes home to the same driver path.
    """
    driver = from_staged(path, staging_dir(rank_zero_staging)) if rank_zero_staging else path
    return to_staged(driver, staging_dir(own_staging)) if own_staging and os.path.isabs(driver) else driver


def to_staged(path: str, staging: str) -> str:
    return os.path.join(staging, os.path.splitdrive(path)[1].lstrip("/\\"))


def _map_strings(value: Any, mapping: Callable[[str], str]) -> Any:
    """``value`` with ``mapping`` applied to every string in it, dict keys and nested containers included."""
    if isinstance(value, str):
        return mapping(value)
    if isinstance(value, dict):
        return {_map_strings(k, mapping): _map_strings(v, mapping) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_map_strings(v, mapping) for v in value)
    return value


def from_staged(value: Any, staging: str) -> Any:
    """``value`` (a path, or dicts/lists/tuples holding paths) with staged paths mapped back to the driver's."""
    prefix = staging + os.sep
    return _map_strings(value, lambda s: s[len(staging) :] if s.startswith(prefix) else s)


def _staged_value(value: Any, staging: str) -> Any:
    """The inverse of :func:`from_staged`: absolute paths in ``value`` moved under ``staging``."""
    return _map_strings(value, lambda s: to_staged(s, staging) if os.path.isabs(s) else s)


def collect(staging: str, outbox: Outbox) -> dict[str, bytes | SentFile]:
    """Every file written under ``staging``, keyed by its path on the driver (large ones sent through ``outbox``).

    Symbolic links are left out: loggers link to files of their own (W&B's ``debug.log``, ``latest-run``,
    a log under the home directory), and the files they point to either come back themselves or
    are none of the driver's business.
    """
    files = {}
    for directory, _, names in os.walk(staging):
        for name in names:
            path = os.path.join(directory, name)
            if os.path.islink(path):
                continue
            files[from_staged(path, staging)] = outbox.take(path)
    return files


class StagingMirror:
    """What changed under a staging directory since the last look: sent home with each recovery checkpoint.

    A fit that may restart its workers mirrors rank 0's staged files on the driver as it trains, so
    the checkpoints of finished epochs are on the driver's machine even if rank 0's node is lost.
    Files are compared by modification time and size; unchanged ones are not read again. A large changed file
    is linked (no copy) into a snapshot beside the staging directory on the training thread, and copied to the
    driver's folder ``home`` in the background (:meth:`send`), so the version the checkpoint saw goes home even if
    a later epoch replaces it. (A file rewritten in place, not replaced, before its copy ends may go home half
    old: the next checkpoint, or the call's end, sends it again.)
    """

    def __init__(self, staging: str, home: str | None = None) -> None:
        self._staging = staging
        self._home = home
        self._snapshots = f"{staging}-snapshots"
        self._seen: dict[str, tuple[int, int]] = {}

    def changes(self) -> tuple[dict[str, Any], list[str]]:
        """``(files written or changed since the last call, files removed)``, keyed by driver paths; a large file's
        value is its snapshot until :meth:`send`."""
        now: dict[str, tuple[int, int]] = {}
        for directory, _, names in os.walk(self._staging):
            for name in names:
                path = os.path.join(directory, name)
                with contextlib.suppress(OSError):
                    if not os.path.islink(path):
                        info = os.stat(path)
                        now[path] = (info.st_mtime_ns, info.st_size)
        changed: dict[str, Any] = {}
        outbox = Outbox(self._home)
        for path, signature in now.items():
            if self._seen.get(path) != signature:
                with contextlib.suppress(OSError):
                    changed[from_staged(path, self._staging)] = self._snapshot(path, outbox.fits(signature[1]))
        removed = [from_staged(path, self._staging) for path in self._seen if path not in now]
        self._seen = now
        return changed, removed

    def _snapshot(self, path: str, inline: bool) -> bytes | _Snapshot:
        if inline:
            with open(path, "rb") as f:
                return f.read()
        make_private_dir(self._snapshots)
        snapshot = os.path.join(self._snapshots, uuid.uuid4().hex)
        try:
            os.link(path, snapshot)
        except OSError:  # another filesystem, or one without links: a copy, on the training thread
            shutil.copyfile(path, snapshot)
        return _Snapshot(snapshot)

    def send(self, changed: dict[str, Any]) -> dict[str, bytes | SentFile]:
        """``changed`` with each snapshot copied to the driver's folder (in the background, after :meth:`changes`)."""
        outbox = Outbox(self._home)
        sent: dict[str, bytes | SentFile] = {}
        for path, value in changed.items():
            if isinstance(value, _Snapshot):
                try:
                    sent[path] = outbox.send(value.path)
                finally:
                    os.remove(value.path)
            else:
                sent[path] = value
        return sent


@dataclass(frozen=True)
class _Snapshot:
    path: str


def seed(staging: str, files: dict[str, bytes | SentFile]) -> None:
    """Put ``files`` (keyed by driver paths) where rank 0 staged under ``staging`` would have written them.

    A restarted rank 0 then finds what the fit wrote before the failure (a CSV log it appends to,
    the checkpoints its checkpoint callback may replace), as a rank 0 on the driver's machine does.
    """
    for path, data in files.items():
        target = to_staged(path, staging)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        received(data, target)


def recent(directories: Iterable[str], since: float, outbox: Outbox) -> dict[str, bytes | SentFile]:
    """The files under ``directories`` modified at or after ``since`` (a ``time.time()``), keyed by path; large ones
    sent through ``outbox``."""
    found: dict[str, bytes | SentFile] = {}
    for root in {resolved(d) for d in directories}:
        for directory, _, names in os.walk(root):
            for name in names:
                path = os.path.join(directory, name)
                with contextlib.suppress(OSError):
                    if not os.path.islink(path) and os.stat(path).st_mtime >= since:
                        found[path] = outbox.take(path)
    return found


def collect_and_remove(name: str, home: str | None = None) -> dict[str, bytes | SentFile]:
    """On rank 0's node: the files of the staging directory ``name`` (large ones through ``home``), which is then
    removed."""
    staging = staging_dir(name)
    files = collect(staging, Outbox(home))
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(f"{staging}-snapshots", ignore_errors=True)
    return files


def fetch_after_failure(
    area: StagingArea, timeout_s: float, scope: WriteScope, home: str | None = None, rank_zero: Any = None
) -> list[str]:
    """After a failed call: bring what rank 0 staged in ``area`` to the driver; returns the paths written.

    ``rank_zero``: rank 0's actor, when its process came out of the call alive: it collects the files (it has
    everything imported). Else a 0-CPU task on that node does, needing none of the resources the workers held; on a
    loaded node its new process's imports (ray_lightning, Lightning) take a while at Ray's niceness.
    """
    if rank_zero is not None:
        ref = rank_zero.collect_staged.remote(area.name, home)
    else:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(num_cpus=0, max_retries=0)(collect_and_remove)
        on_node = NodeAffinitySchedulingStrategy(area.node_id, soft=False)
        ref = task.options(scheduling_strategy=on_node).remote(area.name, home)
    return write(ray.get(ref, timeout=timeout_s), scope)
