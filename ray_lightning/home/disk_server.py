"""The server side of :mod:`.driver_disk`: a Ray actor on the driver's node that keeps one private folder.

This module imports only the standard library: its class is sent to the actor by value
(:func:`ray_lightning.home.driver_disk.start_server`), so the actor's process imports neither torch
nor this package (a few tens of MB, started in about a second).

Every path it is given is relative to its folder and stays inside it. A file is written beside its name
(``<name>.partial-<id>``, :meth:`DiskServer.append`) and renamed into place when complete
(:meth:`DiskServer.commit`): a reader never sees half a file. Growth law: it holds one chunk per call in
flight (a writer sends one at a time), whatever the file's size.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any


class DiskServer:
    """Files under one folder of this machine, for the ranks of this driver's fits (relative ``/`` paths)."""

    def __init__(self, prefix: str) -> None:
        self._root = tempfile.mkdtemp(prefix=prefix)  # private (0700): only this user reads the checkpoints

    def root(self) -> str:
        """The folder on this machine (said in logs and errors)."""
        return self._root

    def _path(self, relative: str) -> str:
        path = os.path.normpath(os.path.join(self._root, relative.lstrip("/")))
        if path != self._root and not path.startswith(self._root + os.sep):
            raise ValueError(f"{relative!r} is outside the driver's recovery folder")
        return path

    def _relative(self, path: str) -> str:
        return os.path.relpath(path, self._root).replace(os.sep, "/")

    def info(self, relative: str) -> dict[str, Any] | None:
        """``{"name", "size", "type"}`` of a file or folder; None if there is none."""
        path = self._path(relative)
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            return None
        kind = "directory" if os.path.isdir(path) else "file"
        return {"name": relative.strip("/"), "size": stat.st_size if kind == "file" else 0, "type": kind}

    def ls(self, relative: str) -> list[dict[str, Any]] | None:
        """The entries of a folder (a file: itself); None if there is none."""
        path = self._path(relative)
        if os.path.isfile(path):
            return [self.info(relative)]  # type: ignore[list-item]
        if not os.path.isdir(path):
            return None
        entries = []
        for name in sorted(os.listdir(path)):
            found = self.info(self._relative(os.path.join(path, name)))
            if found is not None:  # removed meanwhile
                entries.append(found)
        return entries

    def makedirs(self, relative: str) -> None:
        os.makedirs(self._path(relative), exist_ok=True)

    def rm(self, relative: str, recursive: bool) -> bool:
        """Remove a file, or a folder (with ``recursive``, and what is in it); False if there was none."""
        path = self._path(relative)
        if os.path.isdir(path) and path != self._root:
            if recursive:
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.rmdir(path)
            return True
        try:
            os.remove(path)
        except FileNotFoundError:
            return False
        return True

    def mv(self, source: str, target: str) -> bool:
        """Rename ``source`` to ``target`` (replacing it); False if there is no ``source``."""
        path, destination = self._path(source), self._path(target)
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        try:
            os.replace(path, destination)
        except FileNotFoundError:
            return False
        return True

    def append(self, relative: str, data: bytes, offset: int) -> int:
        """Write ``data`` at ``offset`` of a partial file (0: a new one); returns the file's size. Writing at an
        offset, not appending, makes a chunk sent twice harmless."""
        path = self._path(relative)
        if offset == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "r+b" if offset else "wb") as f:
            f.seek(offset)
            f.write(data)
            f.truncate()
            return f.tell()

    def commit(self, partial: str, relative: str) -> None:
        """A partial file becomes ``relative``, whole (created empty if nothing was written)."""
        source = self._path(partial)
        if not os.path.exists(source):
            open(source, "wb").close()
        os.replace(source, self._path(relative))

    def read(self, relative: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of a file; None if there is none."""
        try:
            with open(self._path(relative), "rb") as f:
                f.seek(start)
                return f.read(max(0, end - start))
        except FileNotFoundError:
            return None

    def remove_all(self) -> None:
        """The whole folder, when the driver is done with it."""
        shutil.rmtree(self._root, ignore_errors=True)
