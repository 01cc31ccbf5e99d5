"""Where a Tune trial keeps its files, as a URL the ranks write to themselves.

Tune gives a trial's function no public way to its storage: ``ray.train._internal.session.get_session().storage``
(a ``StorageContext``, a DeveloperAPI reached through a private module) holds the pyarrow filesystem and the
trial's path in it. The ranks write with fsspec (what torch's distributed checkpoint and Lightning use), so the
pair is named as an fsspec URL, and checked to be the same place (:func:`trial_storage_url`) before any rank
writes there.
"""

from __future__ import annotations

import contextlib
import importlib
import posixpath
import uuid
from typing import Any

SESSION = "ray.train._internal.session"
GET_SESSION = "get_session"  # a function of SESSION; its result's ``storage`` is the trial's StorageContext
STORAGE = "ray.train._internal.storage"
STORAGE_CONTEXT = "StorageContext"  # a class of STORAGE
DIR_NAME = "_make_checkpoint_dir_name"  # a static method of STORAGE_CONTEXT: the folder of the checkpoint numbered N
# pyarrow's filesystem type names, with the fsspec scheme of the same store.
_SCHEMES = {"local": "", "s3": "s3://", "gcs": "gs://"}


def _storage() -> Any:
    """This process's Tune trial StorageContext, or None outside a trial."""
    try:
        session = getattr(importlib.import_module(SESSION), GET_SESSION)()
    except (ImportError, AttributeError):
        return None
    storage = getattr(session, "storage", None)
    if storage is None or getattr(storage, "trial_dir_name", None) is None:
        return None
    return storage


def in_trial() -> bool:
    """Whether this process runs a Tune trial's function."""
    return _storage() is not None


def trial_storage_url() -> tuple[str | None, str]:
    """``(URL of this trial's folder in Tune's storage, why not)``: the URL is None outside a trial, or where the
    storage is one fsspec cannot be shown to reach (a custom filesystem, another scheme).

    The check writes a small file through fsspec and looks for it through Tune's own filesystem, so both
    name the same place (an S3 endpoint set for one and not the other is caught here).
    """
    storage = _storage()
    if storage is None:
        return None, "not in a Tune trial"
    filesystem = storage.storage_filesystem
    scheme = _SCHEMES.get(getattr(filesystem, "type_name", ""))
    if scheme is None:
        return None, f"Tune's storage filesystem {getattr(filesystem, 'type_name', filesystem)!r} has no fsspec URL"
    url = scheme + storage.trial_fs_path
    probe = posixpath.join(storage.trial_fs_path, f".ray_lightning-check-{uuid.uuid4().hex[:8]}")
    try:
        import fsspec
        import pyarrow.fs

        fs, path = fsspec.core.url_to_fs(scheme + probe)
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        fs.pipe_file(path, b"ray_lightning checks that the ranks can write to this trial's storage\n")
        try:
            seen = filesystem.get_file_info(probe).type != pyarrow.fs.FileType.NotFound
        finally:
            with contextlib.suppress(Exception):
                fs.rm_file(path)
    except Exception as error:  # noqa: BLE001 - any failure means: not reachable this way
        return None, f"{url} cannot be written with fsspec here: {type(error).__name__}: {error}"
    if not seen:
        return None, f"{url} through fsspec is not where Tune's filesystem writes (another endpoint?)"
    return url, ""


def next_checkpoint_url() -> str:
    """The URL of the folder Tune will persist this trial's next reported checkpoint into.

    Tune numbers them (``checkpoint_000003``) and raises the number just before it copies a reported
    directory there; it copies only the files it is given, so what the ranks wrote into that folder before
    the report stays beside them.
    """
    storage = _storage()
    if storage is None:
        raise RuntimeError("ray_lightning: Tune's storage was asked for outside a Tune trial.")
    context = getattr(importlib.import_module(STORAGE), STORAGE_CONTEXT)
    folder = getattr(context, DIR_NAME)(storage.current_checkpoint_index + 1)
    return _SCHEMES[storage.storage_filesystem.type_name] + posixpath.join(storage.trial_fs_path, folder)


def checkpoint_url(checkpoint: Any) -> str | None:
    """A Tune ``Checkpoint``'s folder as a URL the ranks read in place, or None where fsspec cannot name it."""
    scheme = _SCHEMES.get(getattr(checkpoint.filesystem, "type_name", ""))
    return None if scheme is None else scheme + checkpoint.path
