"""A restartable fit's workers: the batch policy at this world size, and the training position across a restart.

Installed on every rank of a fit that may restart (``max_failures``, ``num_workers=(min, max)``, ``storage_path``)
as :class:`ElasticTraining`, which the strategy asks for the training loader (``process_dataloader``).

Decisions:

* **Position.** Lightning resumes a mid-epoch checkpoint by starting a plain ``DataLoader`` over from the
  epoch's first batch (Lightning#9063). Each checkpoint here holds how many of the epoch's samples were
  trained (global, in the epoch's ``DistributedSampler`` order); a fit resumed inside that epoch reads the
  rest of the same order, dealt over the ranks it has now (:class:`ContinuingSampler`), and its batch count
  starts where that rest ends on time, so no sample is lost or repeated, on any world size. The loader's
  length stays a whole epoch's, so the epochs after it are whole. Another sampler: Lightning's behaviour,
  with a warning.
* **Batch.** ``"keep_global_batch"``: the global batch is the user's per-worker batch x ``accumulate_grad_batches``
  x ``max`` workers; on ``w`` workers the smallest accumulation that keeps it with a per-worker batch no larger
  than the user's is taken (memory per worker never grows). Sizes that cannot be kept fail at the first fit for
  every ``w`` in ``[min, max]``. ``"scale_lr"``: the learning rates are those of ``max`` workers, scaled by
  ``w / max`` (the checkpoint records the size its rates are for). ``"leave"``: nothing changes.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from ray_lightning import _lightning, namespaces

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger(__name__)

# Where a checkpoint keeps the epoch's position and the size its learning rates are for.
CHECKPOINT_KEY = "ray_lightning_elastic"


class ContinuingSampler(DistributedSampler):
    """``DistributedSampler``'s order for the epoch ``resume_epoch`` from global position ``start`` on, dealt over
    ``num_replicas`` ranks; other epochs are the plain sampler's. Its length is always a whole epoch's."""

    def __init__(self, base: DistributedSampler, start: int, resume_epoch: int) -> None:
        super().__init__(
            base.dataset,
            num_replicas=base.num_replicas,
            rank=base.rank,
            shuffle=base.shuffle,
            seed=base.seed,
            drop_last=base.drop_last,
        )
        self.start = start
        self.resume_epoch = resume_epoch
        self.epoch = resume_epoch

    def rest(self) -> list[int]:
        """This rank's part of the rest of the resumed epoch."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            order = list(range(len(self.dataset)))
        rest = order[min(self.start, len(order)) :]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.num_replicas]
        elif rest and len(rest) % self.num_replicas:
            rest += rest[: self.num_replicas - len(rest) % self.num_replicas]
        return rest[self.rank :: self.num_replicas]

    @override
    def __iter__(self) -> Any:
        if self.epoch != self.resume_epoch:
            return super().__iter__()
        return iter(self.rest())


class ElasticTraining(*namespaces.every("callbacks.Callback")):
    """On every rank of a restartable fit: the batch policy and the training position (see the module docstring).

    ``max_workers``: the reference size (None: a fixed-size fit, whose batch is left as it is);
    ``min_workers``: the least it may run on; ``batch_policy``: ``config.elastic.BATCH_POLICIES``.
    """

    def __init__(self, max_workers: int | None, min_workers: int | None, batch_policy: str | None) -> None:
        self.max_workers, self.min_workers, self.batch_policy = max_workers, min_workers, batch_policy
        self._restored: dict[str, Any] = {}
        self._lr_world: int | None = None
        self._pass: tuple[int, int, int, int] | None = None  # (epoch, samples before, batches before, samples/batch)
        self._user_accumulation: int | None = None

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        # A key of its own, not a callback state: a checkpoint loaded where this callback is absent (a plain
        # Trainer) would warn about a missing callback.
        checkpoint[CHECKPOINT_KEY] = {
            "epoch": trainer.current_epoch,
            "samples": self.samples_trained(trainer),
            "lr_world": self._lr_world,
        }

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self._restored = dict(checkpoint.get(CHECKPOINT_KEY) or {})

    def samples_trained(self, trainer: pl.Trainer) -> int:
        """The current epoch's samples trained so far, over every rank."""
        if self._pass is None or self._pass[0] != trainer.current_epoch:
            return 0
        _, before, batches_before, per_batch = self._pass
        return before + (_lightning.batches_processed(trainer) - batches_before) * per_batch

    def process_loader(self, trainer: pl.Trainer, loader: Any) -> Any:
        """The training loader for this world size and position (``strategy.process_dataloader``)."""
        world = trainer.world_size
        if self.batch_policy == "keep_global_batch" and self.max_workers is not None:
            loader = self._keep_global_batch(trainer, loader, world)
        sampler = getattr(loader, "sampler", None)
        batch_size = getattr(loader, "batch_size", None) or 1
        epoch, start, batches_before = trainer.current_epoch, 0, 0
        restored = self._restored
        if restored.get("epoch") == epoch and restored.get("samples", 0) > 0:
            # Resumed inside this epoch: Lightning's restored batch count is this epoch's.
            start, batches_before = int(restored["samples"]), _lightning.batches_processed(trainer)
        if start and type(sampler) is DistributedSampler and type(loader) is DataLoader:
            continuing = ContinuingSampler(sampler, start, epoch)
            loader = _rebuilt(loader, batch_size, continuing)
            rest = len(continuing.rest())
            rest_batches = rest // batch_size if loader.drop_last else math.ceil(rest / batch_size)
            batches_before = max(0, len(loader) - rest_batches)
            _lightning.set_batches_done(trainer, batches_before)
            log.info("ray_lightning: epoch %d goes on after %d of its samples, on %d workers", epoch, start, world)
        elif callable(getattr(trainer.datamodule, "resumed_batches", None)):
            rest_batches = trainer.datamodule.resumed_batches()  # a RayDataModule: it skips the rows itself
            if rest_batches is not None and _sized(loader):
                batches_before = max(0, len(loader) - rest_batches)
                _lightning.set_batches_done(trainer, batches_before)
        elif start:
            log.warning(
                "ray_lightning: the training loader's sampler is %s, not a DistributedSampler: the resumed epoch %d "
                "starts over from its first batch (Lightning's behaviour).",
                type(sampler).__name__,
                epoch,
            )
        # Counted from here: the samples this epoch trained before (start) and those of each batch from now on.
        self._pass = (epoch, start, batches_before, batch_size * world)
        return loader

    def _keep_global_batch(self, trainer: pl.Trainer, loader: Any, world: int) -> Any:
        assert self.max_workers is not None
        if self._user_accumulation is None:
            self._user_accumulation = int(trainer.accumulate_grad_batches)
        accumulation = self._user_accumulation
        batch = getattr(loader, "batch_size", None) if type(loader) is DataLoader else None
        # Horovod fixes the accumulation when it wraps the optimizer, before the loader exists: only the batch moves.
        fixed = accumulation if getattr(trainer.strategy, "fixed_accumulation", False) else None
        if batch:
            total = batch * accumulation * self.max_workers
            sizes = {w: global_batch_split(total, w, batch, fixed) for w in self._sizes()}
        else:
            # Another loader (RayDataModule's) keeps its batch: the accumulation alone makes up for fewer workers.
            total = accumulation * self.max_workers
            sizes = {w: _accumulated(total, w, fixed) for w in self._sizes()}
        bad = [w for w, split in sizes.items() if split is None]
        if bad:
            what = f"{batch} x {accumulation}" if batch else f"{type(loader).__name__}'s batch x {accumulation}"
            how = " with accumulate_grad_batches fixed, as Horovod has it" if fixed else ""
            how += "" if batch else " by accumulation alone: only a torch DataLoader's batch size can change"
            raise ValueError(
                f"ray_lightning: batch_policy='keep_global_batch' cannot keep the global batch {what} "
                f"(accumulate_grad_batches) x {self.max_workers} workers on {', '.join(map(str, bad))} workers (it "
                f"does not divide{how}); pick sizes every size in num_workers=(min, max) divides, or "
                "batch_policy='scale_lr' or 'leave'."
            )
        new_batch, new_accumulation = sizes[world]  # type: ignore[misc]
        trainer.accumulate_grad_batches = new_accumulation
        if not batch or new_batch == batch:
            return loader
        return _rebuilt(loader, new_batch, loader.sampler)

    def _sizes(self) -> range:
        assert self.max_workers is not None
        return range(self.min_workers or self.max_workers, self.max_workers + 1)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        world = trainer.world_size
        if self.batch_policy == "scale_lr" and self.max_workers is not None:
            was = self._restored.get("lr_world") or self.max_workers
            scale_learning_rates(trainer, world / was)
            self._lr_world = world
        if self.max_workers is not None and trainer.global_rank == 0:
            loader = trainer.train_dataloader
            batch = getattr(loader, "batch_size", None)
            rates = sorted({g["lr"] for o in trainer.optimizers for g in o.param_groups if "lr" in g})
            global_batch = f"{batch * world * trainer.accumulate_grad_batches}" if batch else "?"
            namespaces.of(trainer.strategy).pl("utilities.rank_zero.rank_zero_info")(
                f"ray_lightning: {world} of at most {self.max_workers} workers x batch {batch or '?'} x "
                f"accumulate_grad_batches {trainer.accumulate_grad_batches} = global batch {global_batch}; "
                f"learning rate {', '.join(f'{r:g}' for r in rates) or '-'} (batch_policy={self.batch_policy!r})"
            )

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch = trainer.current_epoch
        if self._pass is not None and self._pass[0] != epoch:
            self._pass = (epoch, 0, 0, self._pass[3])


def global_batch_split(
    global_batch: int, world: int, most: int, accumulation: int | None = None
) -> tuple[int, int] | None:
    """``(per-worker batch, accumulation)`` that make ``global_batch`` on ``world`` workers, the per-worker batch
    at most ``most`` if any does (else the largest that divides); None when ``world`` does not divide it.
    ``accumulation``: the one it must be (None: any)."""
    if global_batch % world:
        return None
    per_world = global_batch // world
    if accumulation is not None:
        return (per_world // accumulation, accumulation) if per_world % accumulation == 0 else None
    splits = [(per_world // a, a) for a in range(1, per_world + 1) if per_world % a == 0]
    fitting = [s for s in splits if s[0] <= most]
    return fitting[0] if fitting else splits[0]


def _accumulated(total: int, world: int, fixed: int | None) -> tuple[int, int] | None:
    """``(1, accumulation)`` making ``total`` batches a step on ``world`` workers (None: it does not divide)."""
    if total % world or fixed not in (None, total // world):
        return None
    return 1, total // world


def scale_learning_rates(trainer: pl.Trainer, factor: float) -> None:
    """Every optimizer param group's learning rate, and its schedulers' base rates, times ``factor``."""
    if factor == 1:
        return
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            if "lr" in group:
                group["lr"] = group["lr"] * factor
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] * factor
    for config in trainer.lr_scheduler_configs:
        base = getattr(config.scheduler, "base_lrs", None)
        if base is not None:
            config.scheduler.base_lrs = [rate * factor for rate in base]


def _rebuilt(loader: DataLoader, batch_size: int, sampler: Any) -> DataLoader:
    """``loader`` with another batch size or sampler, everything else as it was."""
    return DataLoader(
        loader.dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
    )


def _sized(loader: Any) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True


def find(trainer: pl.Trainer) -> ElasticTraining | None:
    """This fit's :class:`ElasticTraining`, if it has one."""
    return next((c for c in trainer.callbacks if isinstance(c, ElasticTraining)), None)
