"""Recovery checkpoints and files on the driver's machine without ``storage_path``, written and read by the ranks
in chunks.

A fit that may restart (``max_failures > 0``, an elastic ``num_workers``) without ``storage_path`` keeps its
recovery checkpoints on the driver's machine, as before, so no shared filesystem is needed. The bytes do not
pass through the driver's process or rank 0's memory: one small actor on the driver's node
(:class:`~.disk_server.DiskServer`, 0 CPUs, one per driver process) owns a private temporary folder, and the
fsspec filesystem ``rlhome://<server>/<path>`` (:class:`DriverDiskFileSystem`, registered by :mod:`.storage`)
lets every rank write and read files there. The recovery checkpoints then take the path they take with
``storage_path`` (:mod:`.storage`): a sharded strategy's ranks each write their own shards (torch's distributed
checkpoint), DDP's rank 0 one file, in the background; a marker makes a checkpoint complete; a restart's ranks
read their own parts in place.

Growth law: every byte of a checkpoint crosses to the driver's node once, in chunks of :data:`CHUNK_BYTES`; a
writing rank holds one chunk beyond the copy of its part it writes from, the server one chunk per writer, the
driver's process none. A restart's rank reads its part in the same chunks. The disk use is one checkpoint (the
newest complete one, plus the one being written).

The files the ranks off the driver's machine wrote (checkpoints of ``ModelCheckpoint``, a sharded checkpoint's
parts, logs, what a Fabric function saved) come home the same way (:func:`send_file`, :func:`take_file`): a rank
copies each large one into a folder of the server, in chunks, and sends only its URL; the driver moves it to its
path (a rename: the server's folder is on its machine; a Ray Client's driver reads it in chunks).
"""

from __future__ import annotations

import atexit
import os
import shutil
import uuid
from typing import Any

import ray
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from ray_lightning.errors import StorageError

PROTOCOL = "rlhome"
CHUNK_BYTES = 16 * 2**20
# One chunk's write or read on the driver's node: far above what 16 MiB takes on any network that trains.
CALL_TIMEOUT_S = 300.0
_EXIT_TIMEOUT_S = 10.0  # what the driver's exit waits, at most, to remove the folder
_NAMESPACE = "ray_lightning"
_PREFIX = "ray_lightning-recovery-"

# This process's server: (the Ray cluster and job it belongs to, its name, its handle, its folder when it is on this
# machine, else None).
_server: tuple[str, str, Any, str | None] | None = None


def server_name() -> str:
    """This driver's server (started on first use, on this node, for this Ray job): its name in ``rlhome://``."""
    global _server
    # A job id alone names no cluster: the first job of every new cluster is 01000000.
    context = ray.get_runtime_context()
    try:
        cluster = context.gcs_address
    except Exception:  # noqa: BLE001 - a Ray Client's context has none: one cluster per client connection
        cluster = "client"
    job = f"{cluster}/{context.get_job_id()}"
    if _server is None or _server[0] != job:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from ray_lightning.home import disk_server

        # The class goes to the actor by value: its process imports neither torch nor this package.
        ray.cloudpickle.register_pickle_by_value(disk_server)
        name = f"ray_lightning-disk-{uuid.uuid4().hex[:12]}"
        actor_class = ray.remote(disk_server.DiskServer)
        # A Ray Client's machine is no node of the cluster: its folder is then on a node Ray picks.
        client = ray.util.client.ray.is_connected()
        here = "DEFAULT" if client else NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), False)
        handle = actor_class.options(
            name=name, namespace=_NAMESPACE, num_cpus=0, max_concurrency=16, scheduling_strategy=here
        ).remote(_PREFIX)
        try:
            # Started and registered under its name before any rank looks it up.
            root = ray.get(handle.root.remote(), timeout=CALL_TIMEOUT_S)
        except Exception as error:
            raise StorageError(
                "ray_lightning: the actor that keeps recovery checkpoints on the driver's machine did not start "
                f"within {CALL_TIMEOUT_S:g} s: {type(error).__name__}: {error}. Pass storage_path= to write them "
                "elsewhere."
            ) from error
        if _server is None:
            # Its folder goes at exit (before Ray's own exit handler, registered earlier, shuts Ray down).
            atexit.register(stop_server)
        _server = (job, name, handle, None if client else root)
    return _server[1]


def server_folder() -> str:
    """The server's folder on the driver's machine (where the recovery checkpoints of this driver's fits are)."""
    handle = ray.get_actor(server_name(), namespace=_NAMESPACE)
    return ray.get(handle.root.remote(), timeout=CALL_TIMEOUT_S)


def run_url(folder: str) -> str:
    """The URL of ``folder`` (one call's checkpoints) in this driver's server."""
    return f"{PROTOCOL}://{server_name()}/{folder}"


def stop_server() -> None:
    """Remove the server's folder and end it (at exit of the driver; it also ends with the driver's job)."""
    global _server
    if _server is None:
        return
    handle = _server[2]
    _server = None
    if not ray.is_initialized():
        return  # Ray was shut down: the actor ended with the job
    try:
        ray.get(handle.remove_all.remote(), timeout=_EXIT_TIMEOUT_S)
        ray.kill(handle)
    except Exception:  # noqa: BLE001 - Ray is shut down already: the folder went with the node's temp files
        pass


def send_file(local: str, url: str) -> None:
    """Copy the file ``local`` of this machine to ``url`` (``rlhome://<server>/<path>``), in chunks: a rank's file
    comes home, or the driver's goes to a rank. It appears whole or not at all."""
    mine = _local_path(url)
    if mine is not None:  # the driver, beside its server: a copy on its own disk
        os.makedirs(os.path.dirname(mine), exist_ok=True)
        partial = f"{mine}.partial-{uuid.uuid4().hex[:8]}"
        shutil.copyfile(local, partial)
        os.replace(partial, mine)
        return
    filesystem = DriverDiskFileSystem()
    with open(local, "rb") as source, filesystem.open(url, "wb") as target:
        shutil.copyfileobj(source, target, CHUNK_BYTES)


def take_file(url: str, local: str) -> None:
    """Move ``url`` of a server to the path ``local`` of this machine: a rename on the server's own machine, else
    read in chunks. ``local`` is written beside its name and renamed when whole."""
    partial = f"{local}.partial-{uuid.uuid4().hex[:8]}"
    mine = _local_path(url)
    try:
        if mine is not None:
            shutil.move(mine, partial)
        else:
            filesystem = DriverDiskFileSystem()
            with filesystem.open(url, "rb") as source, open(partial, "wb") as target:
                shutil.copyfileobj(source, target, CHUNK_BYTES)
            filesystem.rm(url)
        os.replace(partial, local)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def remove(url: str) -> None:
    """Remove ``url`` (a file or a folder) of a server, if it is there."""
    try:
        DriverDiskFileSystem().rm(url, recursive=True)
    except FileNotFoundError:
        pass


def _local_path(url: str) -> str | None:
    """Where ``url`` is on this machine, when it names this process's server and that runs here."""
    if _server is None or _server[3] is None:
        return None
    name, _, relative = DriverDiskFileSystem._strip_protocol(url).partition("/")
    if name != _server[1]:
        return None
    path = os.path.normpath(os.path.join(_server[3], relative))
    if not path.startswith(_server[3] + os.sep):
        raise ValueError(f"{url!r} is outside the driver's folder")
    return path


class DriverDiskFileSystem(AbstractFileSystem):
    """fsspec's view of a driver's recovery folder: ``rlhome://<server>/<path relative to its folder>``."""

    protocol = PROTOCOL
    root_marker = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handles: dict[str, Any] = {}

    def _call(self, path: str, method: str, *args: Any) -> Any:
        """``method(relative path, *args)`` on the server that ``path`` names, bounded by :data:`CALL_TIMEOUT_S`."""
        name, _, relative = self._strip_protocol(path).partition("/")
        try:
            if name not in self._handles:
                self._handles[name] = ray.get_actor(name, namespace=_NAMESPACE)
            return ray.get(getattr(self._handles[name], method).remote(relative, *args), timeout=CALL_TIMEOUT_S)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError, ValueError) as error:
            if isinstance(error, ValueError) and "outside" in str(error):
                raise
            why = (
                f"did not answer within {CALL_TIMEOUT_S:g} s"
                if isinstance(error, ray.exceptions.GetTimeoutError)
                else "is gone"
            )
            raise StorageError(
                f"ray_lightning: the driver's recovery folder (actor {name} on the driver's node) {why}, for "
                f"{method} of {path}: {type(error).__name__}: {error}"
            ) from error

    def _named(self, path: str, entry: dict[str, Any]) -> dict[str, Any]:
        name = self._strip_protocol(path).partition("/")[0]
        return {**entry, "name": f"{name}/{entry['name']}".rstrip("/")}

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        entries = self._call(path, "ls")
        if entries is None:
            raise FileNotFoundError(path)
        named = [self._named(path, e) for e in entries]
        return named if detail else [e["name"] for e in named]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        found = self._call(path, "info")
        if found is None:
            raise FileNotFoundError(path)
        return self._named(path, found)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._call(path, "makedirs")

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._call(path, "makedirs")

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        for one in [path] if isinstance(path, str) else path:
            if not self._call(one, "rm", recursive):
                raise FileNotFoundError(one)

    def rm_file(self, path: str) -> None:
        self.rm(path)

    def _rm(self, path: str) -> None:
        self.rm(path)

    def mv(self, path1: str, path2: str, recursive: bool = False, maxdepth: int | None = None, **kwargs: Any) -> None:
        if not self._call(path1, "mv", self._strip_protocol(path2).partition("/")[2]):
            raise FileNotFoundError(path1)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        with self.open(path, "rb") as f:
            if start:
                f.seek(start if start >= 0 else max(0, f.size + start))
            return f.read(None if end is None else (end if end >= 0 else f.size + end) - f.tell())

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        with self.open(path, "wb") as f:
            f.write(value)

    def invalidate_cache(self, path: str | None = None) -> None:
        pass  # nothing is cached: every listing asks the server

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict | None = None,
        **kwargs: Any,
    ) -> _ServerFile:
        return _ServerFile(self, path, mode, block_size or CHUNK_BYTES, cache_options=cache_options)


class _ServerFile(AbstractBufferedFile):
    """A file of the server, read and written in chunks; a written one appears whole when closed."""

    fs: DriverDiskFileSystem

    def _initiate_upload(self) -> None:
        self._partial = f"{self.path}.partial-{uuid.uuid4().hex[:8]}"
        self._sent = 0

    def _upload_chunk(self, final: bool = False) -> bool:
        view = self.buffer.getbuffer()
        try:
            for start in range(0, len(view), CHUNK_BYTES):
                chunk = bytes(view[start : start + CHUNK_BYTES])
                self._sent = self.fs._call(self._partial, "append", chunk, self._sent)
        finally:
            del view
        if final:
            self.fs._call(self._partial, "commit", self.fs._strip_protocol(self.path).partition("/")[2])
        return True

    def _fetch_range(self, start: int, end: int) -> bytes:
        data = self.fs._call(self.path, "read", start, end)
        if data is None:
            raise FileNotFoundError(self.path)
        return data

    def __exit__(self, kind: Any, *rest: Any) -> None:
        if kind is not None and self.mode != "rb" and not self.closed:
            self.discard()  # an exception while writing: no half file appears
            self.closed = True
            if getattr(self, "_partial", None):
                self.fs._call(self._partial, "rm", False)
            return
        super().__exit__(kind, *rest)
