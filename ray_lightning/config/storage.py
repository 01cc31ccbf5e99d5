"""Where a run keeps its checkpoints and logs: ``storage_path`` and ``run_name``, checked before anything is launched.

Without ``storage_path`` (the default) nothing changes: rank 0's files come home to the driver's
machine and no shared filesystem is needed. With it, every file the ranks write goes to
``<storage_path>/<run_name>/``, written by the ranks themselves (:mod:`ray_lightning.home.storage`).
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

from ray_lightning.config.variables import RUN_NAME_ENV, STORAGE_PATH_ENV

# A run's name is one path segment in any filesystem and any object store.
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,199}$")


@dataclass(frozen=True)
class StorageSettings:
    """``path``: an fsspec URL (``s3://bucket/runs``, ``gs://...``, ``file:///mnt/shared``) or an absolute path
    every node mounts; None: files come home to the driver. ``run_name``: the run's folder under it (None: one
    is made from the script's name and the time when the first call starts, :meth:`name_now`)."""

    path: str | None = None
    run_name: str | None = None

    @property
    def enabled(self) -> bool:
        return self.path is not None

    @property
    def is_remote(self) -> bool:
        """Whether the path is an object store or other non-local filesystem (not a mounted directory)."""
        return self.path is not None and not is_local(self.path)

    @classmethod
    def resolve(cls, storage_path: Any = None, run_name: Any = None) -> StorageSettings:
        """Arguments left as None come from ``RAY_LIGHTNING_STORAGE_PATH`` and ``RAY_LIGHTNING_RUN_NAME``."""
        source = "storage_path"
        if storage_path is None and os.environ.get(STORAGE_PATH_ENV, "").strip():
            source, storage_path = f"{STORAGE_PATH_ENV} (environment variable)", os.environ[STORAGE_PATH_ENV].strip()
        name_source = "run_name"
        if run_name is None and os.environ.get(RUN_NAME_ENV, "").strip():
            name_source, run_name = f"{RUN_NAME_ENV} (environment variable)", os.environ[RUN_NAME_ENV].strip()
        return cls(check_storage_path(storage_path, source), check_run_name(run_name, name_source))

    def with_path(self, path: str) -> StorageSettings:
        """These settings with ``path`` (``Trainer(default_root_dir="s3://...")``, when no storage_path was given)."""
        return StorageSettings(check_storage_path(path, "Trainer(default_root_dir=...)"), self.run_name)


def check_storage_path(path: Any, source: str = "storage_path") -> str | None:
    """``path`` as the URL or absolute path files go to; a bad one raises naming ``source`` and why."""
    if path is None:
        return None
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path.strip():
        raise TypeError(f"{source} must be an fsspec URL (s3://bucket/runs) or a path, got {path!r}.")
    path = path.strip()
    for local in ("file://", "local://"):
        if path.lower().startswith(local):
            path = path[len(local) :]
    protocol = protocol_of(path)
    if protocol is None:
        return os.path.abspath(os.path.expanduser(path)).rstrip(os.sep) or os.sep
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ValueError(f"{source}={path!r}: fsspec knows no filesystem for {protocol!r}:// URLs.") from None
    except ImportError as error:
        raise ImportError(
            f"{source}={path!r} needs the package for {protocol}:// URLs on the driver and every node: {error}"
        ) from None
    return path.rstrip("/")


def check_run_name(name: Any, source: str = "run_name") -> str | None:
    if name is None:
        return None
    if not isinstance(name, str) or not _RUN_NAME.match(name):
        raise ValueError(
            f"{source} must be one folder name (letters, digits, and . _ = + -, starting with a letter or digit, "
            f"at most 200 characters), got {name!r}."
        )
    return name


def protocol_of(path: str) -> str | None:
    """The URL's protocol (``s3``), or None for a plain path (``file://`` URLs are plain paths)."""
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", path)
    if match is None or match.group(1).lower() in ("file", "local"):
        return None
    return match.group(1).lower()


def is_local(path: str) -> bool:
    return protocol_of(path) is None


def name_now(script: str | None = None, now: float | None = None, tag: str | None = None) -> str:
    """A run's default name: the script's file name and the local time, ``train-20261125-221530``; ``tag`` (a Tune
    trial's id) is appended."""
    script = script if script is not None else (sys.argv[0] if sys.argv and sys.argv[0] else "")
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.splitext(os.path.basename(script))[0]).strip("._-") or "run"
    name = f"{stem[:80]}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"
    return name if not tag else f"{name}-{re.sub(r'[^A-Za-z0-9._-]+', '_', tag)[:60]}"
