"""How a rank's files travel to the driver: small ones as bytes with the results, large ones through its folder.

A file of :data:`INLINE_BYTES` or more (a checkpoint) is copied by the rank into a folder of the driver's disk
actor (:mod:`.driver_disk`) in chunks, and only its URL (:class:`SentFile`) goes with the results; the driver moves
it into place (:func:`received`). Used for everything that brings files home: a staged rank 0's files when its call
ends (:mod:`.files`), what it mirrors with each recovery checkpoint, what the driver fetches after a failure.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass

log = logging.getLogger(__name__)

# A file up to this size travels in memory with the results; a larger one (a checkpoint) goes through the driver's
# folder (:mod:`.driver_disk`), as do all files once a rank's results hold INLINE_TOTAL_BYTES of them.
INLINE_BYTES = 2**20
INLINE_TOTAL_BYTES = 16 * 2**20


@dataclass(frozen=True)
class SentFile:
    """A file a rank copied into the driver's folder (``rlhome://`` ``url``) instead of sending its bytes."""

    url: str
    size: int


class Outbox:
    """What a rank sends of its files: small ones as bytes, large ones copied into the driver's folder ``home``.

    Growth law: the results hold at most :data:`INLINE_TOTAL_BYTES` of file bytes; a larger file crosses to the
    driver's machine in chunks (:func:`~.driver_disk.send_file`), never whole in any process's memory. Without
    ``home`` (no driver folder: the rank is on the driver's machine, or an old caller) every file is sent as bytes.
    """

    def __init__(self, home: str | None) -> None:
        self._home = home
        self._inline = 0

    def fits(self, size: int) -> bool:
        """Whether a file of ``size`` bytes goes with the results (then counted against their budget)."""
        if self._home is not None and (size >= INLINE_BYTES or self._inline + size > INLINE_TOTAL_BYTES):
            return False
        self._inline += size
        return True

    def take(self, path: str) -> bytes | SentFile:
        """``path``'s bytes, or where it was copied to."""
        if self.fits(os.path.getsize(path)):
            with open(path, "rb") as f:
                return f.read()
        return self.send(path)

    def send(self, path: str) -> SentFile:
        """Copy ``path`` into the driver's folder, in chunks."""
        from ray_lightning.home import driver_disk

        assert self._home is not None, "a file is sent through the driver's folder only when there is one"
        url = f"{self._home}/{uuid.uuid4().hex}-{os.path.basename(path)}"
        driver_disk.send_file(path, url)
        return SentFile(url, os.path.getsize(path))


def new_home() -> str:
    """A new folder of the driver's server (:mod:`.driver_disk`) for one call's files that come home."""
    from ray_lightning.home import driver_disk

    return driver_disk.run_url(f"files-{uuid.uuid4().hex[:12]}")


def remove_sent(home: str) -> None:
    """``home`` (a call's folder, or one file of it) from the driver's server: after the call, what is left in it (a
    failed attempt's files); a file the driver refused."""
    from ray_lightning.home import driver_disk

    try:
        driver_disk.remove(home)
    except Exception as error:  # noqa: BLE001 - Ray is gone (its temp folder with it), or the server is
        log.debug("ray_lightning: could not remove %s: %s", home, error)


def received(data: bytes | SentFile, path: str) -> None:
    """Write what came home for ``path`` there: the bytes, or the file moved from the driver's folder."""
    if isinstance(data, SentFile):
        from ray_lightning.home import driver_disk

        driver_disk.take_file(data.url, path)
    else:
        with open(path, "wb") as f:
            f.write(data)


def discard(data: bytes | SentFile) -> None:
    """What came home and is not written: its copy in the driver's folder goes."""
    if isinstance(data, SentFile):
        remove_sent(data.url)
