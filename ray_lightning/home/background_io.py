"""Rank 0's checkpoint files go to storage beside training: Lightning's ``CheckpointIO``, uploading in the background.

With ``storage_path``, each worker's strategy wraps its ``checkpoint_io`` in :class:`BackgroundCheckpointIO`:
``ModelCheckpoint``'s files (and ``trainer.save_checkpoint`` in a worker) are serialized in memory on the
training thread and written by this process's upload thread (:class:`~ray_lightning.home.storage.Uploads`,
one in flight); a removal (``save_top_k`` rotation) runs after the upload before it; a load waits for
the uploads first, since the file may be one still being written.
"""

from __future__ import annotations

import os
from typing import Any

from typing_extensions import override

from ray_lightning import namespaces
from ray_lightning.home import storage


class BackgroundCheckpointIO(*namespaces.every("plugins.io.CheckpointIO")):
    """Lightning's ``CheckpointIO`` ``inner`` (``TorchCheckpointIO``), writing and removing in the background."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        target = os.fspath(path)
        if storage_options is not None:
            storage.uploads().wait()
            self.inner.save_checkpoint(checkpoint, path, storage_options)  # options only Lightning's own IO knows
            return

        def start() -> Any:
            copy = storage.snapshot(checkpoint)  # the training thread pays for the copy, not for the writing
            return lambda: storage.save_checkpoint(target, copy)

        storage.uploads().submit(target, start)

    @override
    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        storage.uploads().wait()
        return self.inner.load_checkpoint(path, *args, **kwargs)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        target = os.fspath(path)
        storage.uploads().run_in_order(f"the removal of {target}", lambda: storage.remove(target))

    @override
    def teardown(self) -> None:
        self.inner.teardown()
