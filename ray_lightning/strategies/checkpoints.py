"""A strategy's checkpoint calls on Ray: in a worker, timed and never removing the checkpoint the fit resumed from;
on the driver after a fit, written by the workers that still hold it (or refused, saying why).
"""

from __future__ import annotations

import os
from typing import Any

from typing_extensions import override

from ray_lightning import runtime
from ray_lightning.home import spread
from ray_lightning.home.files import path_forms


class WorkerCheckpoints:
    """The checkpoint methods of :class:`~ray_lightning.strategies.workers.RayWorkersMixin` (a base of it)."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self._worker is not None:
            try:
                super().save_checkpoint(checkpoint, filepath, storage_options)
            finally:
                clock = runtime.step_clock()
                if clock is not None:
                    clock.checkpoint_done()  # the time it blocked the training thread (channel.timings)
            return
        # On the driver, after a fit: its workers, while they still hold it, write what a one-process fit would.
        full = "optimizer_states" in checkpoint
        weights_stayed = getattr(self, "_send_full_weights", True) is False
        last_fit = getattr(getattr(self, "_launcher", None), "last_fit", None)
        if (full or weights_stayed) and last_fit is not None and last_fit.save(filepath, weights_only=not full):
            return
        if full:
            raise RuntimeError(
                f"trainer.save_checkpoint({os.fspath(filepath)!r}) on the driver would write a checkpoint without the "
                "optimizers' and schedulers' states: they lived in the Ray workers of the fit, which are gone "
                "(they stay keep_workers_alive_s seconds after a fit, 60 by default, and until the next call; "
                "within that time they write it). Write the weights alone with "
                "trainer.save_checkpoint(path, weights_only=True), or resume from a checkpoint the workers wrote: "
                "ModelCheckpoint(save_last=True) and "
                "trainer.checkpoint_callback.last_model_path."
            )
        self._refuse_if_weights_stayed(f"trainer.save_checkpoint({os.fspath(filepath)!r})")
        # The driver's module, whole: one file (a sharded strategy's own saving is collective, for its workers).
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        load = super().load_checkpoint
        if self._worker is not None and spread.is_spread(checkpoint_path):  # a DDP recovery checkpoint, in parts
            return spread.load(os.fspath(checkpoint_path), lambda path: load(path, *args, **kwargs))
        return load(checkpoint_path, *args, **kwargs)

    def _refuse_if_weights_stayed(self, what: str) -> None:
        if getattr(self, "_send_full_weights", True) is False:
            raise RuntimeError(
                f"{what} on the driver: the trained weights stayed in the workers' checkpoints (full_weights_home), "
                "so this process holds the untrained ones. Use the checkpoints ModelCheckpoint wrote, or pass "
                "full_weights_home=True."
            )

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._worker is None:
            # The driver's optimizers are settings after a fit (home.optimizers); the state stayed in the workers.
            return optimizer.state_dict()
        return super().optimizer_state(optimizer)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._worker is None:
            # The driver's module holds plain tensors (a sharded strategy's reading would need the workers'
            # process group); trainer.save_checkpoint after a fit has the workers write theirs (save_checkpoint).
            return self.lightning_module.state_dict()
        return super().lightning_module_state_dict()

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        # Nothing removes the checkpoint the fit resumed from (ModelCheckpoint's rotation would: Lightning#21813).
        kept = {*(self._worker.keep_checkpoints if self._worker is not None else ()), *self._resumed_from()}
        path = os.fspath(filepath)
        if kept.intersection(path_forms(path)):
            self.namespace.pl("utilities.rank_zero.rank_zero_info")(
                f"ray_lightning: kept {path}: the fit resumed from it, so no checkpoint rotation removes it."
            )
            return
        super().remove_checkpoint(filepath)

    def _resumed_from(self) -> tuple[str, ...]:
        try:
            return path_forms(self.lightning_module.trainer.ckpt_path)
        except (AttributeError, RuntimeError):  # no module, or not attached to a Trainer
            return ()
