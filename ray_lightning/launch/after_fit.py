"""What a one-process Trainer does after ``fit``, done by the fit's workers while they wait for the next call.

After a fit succeeded, its workers keep its Trainer and process group (their clean-up waits for their next call,
or for ``keep_workers_alive_s`` to end them, :mod:`.idle_pool`). The driver's ``trainer.save_checkpoint(path)``
then has every rank save as it would inside the fit: rank 0 one full file (DDP, Horovod, a full state dict),
every rank its shards under a sharded strategy's ``state_dict_type="sharded"``; optimizer, scheduler and loop
state included, so ``fit(ckpt_path=path)`` resumes exactly. Once the workers are gone, the driver refuses, as
before (:meth:`ray_lightning.strategies.workers.RayWorkersMixin.save_checkpoint`).

Growth law: one remote call per worker and per save; each rank writes its own part where the path names it,
nothing passes through the driver. The path must be one the writing ranks reach: any path when they all run on
the driver's machine, else a URL (``s3://...``) or a path in the ``storage_path``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from ray_lightning import _lightning
from ray_lightning.home import storage
from ray_lightning.launch import idle_pool

if TYPE_CHECKING:
    from ray_lightning.launch.worker_group import WorkerGroup


@dataclass(frozen=True)
class LastFit:
    """The workers of the driver's last successful fit, while they may still hold it."""

    group: WorkerGroup
    on_driver_machine: bool  # every worker runs on the driver's machine
    run: storage.Run | None  # the fit's storage (storage_path), which every worker reaches

    def save(self, filepath: Any, weights_only: bool) -> bool:
        """Have the workers write ``trainer.save_checkpoint(filepath)``; False when they are gone."""
        path = os.fspath(filepath)
        local = _lightning.is_local_file_protocol(path)
        if local:
            path = os.path.abspath(path)  # the workers' working directory is not the driver's
        with idle_pool.borrowed(self.group) as waiting:
            if not waiting:
                return False
            if local and not self.on_driver_machine and not (self.run is not None and self.run.holds(path)):
                raise RuntimeError(
                    f"trainer.save_checkpoint({path!r}) after fit: the workers that hold the optimizers' state run on "
                    "other machines, where this path is not this machine's. Save to a URL (s3://...) or a path in "
                    "the strategy's storage_path, or use the files ModelCheckpoint brought to this machine."
                )
            timeout_s = storage.upload_timeout_s()
            refs = [actor.save_after_fit.remote(path, weights_only) for actor in self.group.actors]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            if len(ready) < len(refs):
                raise TimeoutError(
                    f"trainer.save_checkpoint({path!r}) after fit: the workers did not write it within {timeout_s:g} s "
                    "(RAY_LIGHTNING_UPLOAD_TIMEOUT_S)."
                )
            ray.get(refs)  # a rank's failure, with its traceback
        return True
