"""Where the files that come home may land on the driver: the Trainer's directories (:class:`WriteScope`).

Rank 0 sends back files keyed by driver paths; the driver writes each only where its Trainer writes
(:func:`write`), and removes only there what rank 0 removed (:func:`remove`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray_lightning import _lightning
from ray_lightning.home.outbox import SentFile, discard, received

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)


def resolved(path: str) -> str:
    """``path`` absolute, normalised (no ``..``) and with every symbolic link in it followed."""
    return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


CHECKPOINT_EXTENSION = ".ckpt"  # ModelCheckpoint.FILE_EXTENSION, the same in both namespaces
_CHECKPOINT_FILES = ("best_model_path", "last_model_path", "kth_best_model_path")


@dataclass(frozen=True)
class WriteScope:
    """Where the driver lets the files rank 0 sends back land.

    ``directories``: the Trainer's ``default_root_dir``, the loggers' and the checkpoint callbacks'
    directories, as the driver had them before the launch (:meth:`of`): every file Lightning
    writes for these lives under one of them. ``files``: the checkpoint files that checkpoint
    callbacks the workers added themselves (``configure_callbacks``) name in their state, which
    may be anywhere (:meth:`with_checkpoints`). Paths are compared after following symbolic links,
    so neither ``..`` nor a link can lead a write elsewhere (``~/.bashrc``).
    """

    directories: tuple[str, ...] = ()
    files: frozenset[str] = frozenset()
    # A function without a Trainer (Fabric's launch): what its ranks staged is what it wrote through
    # fabric.save and its loggers, at the paths it gave them, wherever those are.
    everywhere: bool = False

    @classmethod
    def of(cls, trainer: pl.Trainer | None, more: Iterable[str] = ()) -> WriteScope:
        """On the driver, before launching (after :func:`make_absolute`); ``more``: other directories
        rank 0 writes to (the loggers' stores, :func:`ray_lightning.home.loggers.output_directories`).
        Without a Trainer: every path (see ``everywhere``)."""
        if trainer is None:
            return cls(everywhere=True)
        found = [*_lightning.output_directories(trainer), *more]
        return cls(tuple(sorted({resolved(p) for p in found if _lightning.is_local_file_protocol(p)})))

    def with_checkpoints(self, callback_states: list[tuple[str, dict[str, Any]]]) -> WriteScope:
        """Also the checkpoint files (``*.ckpt``) named in the workers' checkpoint callbacks' states."""
        named = set()
        for _, state in callback_states:
            if isinstance(state, dict) and "best_k_models" in state and "dirpath" in state:
                named.update(str(p) for p in state["best_k_models"])
                named.update(str(state.get(k) or "") for k in _CHECKPOINT_FILES)
        checkpoints = {resolved(p) for p in named if p.endswith(CHECKPOINT_EXTENSION)}
        return WriteScope(self.directories, self.files | checkpoints, self.everywhere)

    def allows(self, path: str) -> bool:
        if self.everywhere:
            return True
        # The directories are followed; a link in the last place is replaced by the write, not followed.
        target = os.path.join(resolved(os.path.dirname(path) or "."), os.path.basename(path))
        return target in self.files or any(
            target == d or target.startswith(d.rstrip(os.sep) + os.sep) for d in self.directories
        )


def write(files: dict[str, bytes | SentFile], scope: WriteScope) -> list[str]:
    """On the driver: write the files rank 0 sent back at their paths, where ``scope`` allows; returns those written.

    A file elsewhere is not written: the driver logs a warning naming it. A symbolic link at such a
    path is replaced, never written through (it may point at another of the driver's files, e.g. the
    log of an earlier W&B run). A file sent through the driver's folder (:class:`SentFile`) is moved from there.
    """
    written = []
    for path, data in files.items():
        if not scope.allows(path):
            discard(data)
            log.warning(
                "ray_lightning: refused to write %s, sent back by rank 0: it is outside the directories this Trainer "
                "writes to (default_root_dir, the loggers' and checkpoint callbacks' directories: %s) and no "
                "checkpoint callback named it as a checkpoint.",
                path,
                ", ".join(scope.directories) or "none",
            )
            continue
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.islink(path):
            os.unlink(path)
        received(data, path)
        written.append(path)
    return sorted(written)


def remove(paths: Iterable[str], scope: WriteScope) -> list[str]:
    """On the driver: remove files rank 0 removed (a checkpoint its callback replaced), where ``scope`` allows."""
    removed = []
    for path in paths:
        if scope.allows(path) and os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)
            removed.append(path)
    return sorted(removed)
