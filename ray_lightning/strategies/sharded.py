"""What the sharded strategies share: each rank holds part of the model, so checkpoints and the weights are collective.

:class:`ShardedWorkersMixin` goes after :class:`~ray_lightning.strategies.workers.RayWorkersMixin`
and before Lightning's ``ModelParallelStrategy`` (``RayModelParallelStrategy``, ``RayFSDPStrategy``).
Its bases serve the strategies that wrap Lightning's other sharded strategies:
:class:`RankPartsMixin` (where each rank writes or reads its part of a checkpoint, whether and how
the full weights come home; ``RayDeepSpeedStrategy``) and :class:`FullCheckpointsMixin` (a full
checkpoint gathered on rank 0 for restarts and Tune; ``RayFSDP1Strategy``).

* **The weights home.** After ``fit`` the driver's module gets the full trained weights, gathered
  on rank 0 (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``: the other ranks hold
  nothing) and sent like DDP's, when ``full_weights_home`` (default: when the model takes at most
  half the driver's free memory). Otherwise the weights stay in the checkpoints (``ModelCheckpoint``),
  which come home as today.
* **Checkpoints.** A sharded checkpoint is a directory each rank writes its shard into; a rank on
  another machine than the driver writes its shard into a staging directory and sends it home,
  where it lands beside the others at the driver's path. Full checkpoints are written by rank 0.
  Loading takes a directory or a file, saved on any number of ranks (``fit``/``test(ckpt_path=...)``).
* **Storage.** With ``storage_path`` every rank writes its shards of each checkpoint straight into the
  run's folder (a URL or a mounted directory), in the background; a recovery checkpoint is sharded
  too (:meth:`ShardedWorkersMixin.checkpoint_to_storage`), never gathered, and loads on any number of ranks.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from ray_lightning import _lightning, namespaces
from ray_lightning.config.storage import is_local
from ray_lightning.home import storage
from ray_lightning.home.files import local_path
from ray_lightning.home.weights import WeightPart, module_bytes

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from ray_lightning.config.resources import WorkerResources

# The model may come home when it takes at most this share of the driver's free memory.
FULL_WEIGHTS_MEMORY_SHARE = 0.5


def require_sharding_torch(owner: str, resources: WorkerResources, backend: Any) -> None:
    """Refuse a strategy built on FSDP2 and DTensor where torch cannot run it: torch 2.6 with NCCL, 2.9 with gloo
    (CPUs, workers sharing a GPU, or ``process_group_backend="gloo"``): see ``namespaces.GLOO_SHARDING_TORCH``."""
    gloo = not resources.use_gpu or resources.gpus < 1 or (isinstance(backend, str) and backend.lower() == "gloo")
    if gloo:
        why = "FSDP2 over gloo: CPUs or a shared GPU; with one GPU per worker and NCCL, torch 2.6 will do"
        namespaces.require_torch(namespaces.GLOO_SHARDING_TORCH, owner, why)
    namespaces.require_torch(namespaces.SHARDING_TORCH, owner, "FSDP2's public fully_shard and DTensor")


def check_sharding_arguments(use_gpu: bool, backend: Any, timeout: Any, full_weights_home: Any) -> None:
    """The arguments every sharded strategy shares, refused here rather than in every worker."""
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, e.g. timedelta(minutes=30), got {timeout!r}.")
    if backend is not None and (not isinstance(backend, str) or (backend.lower() == "nccl" and not use_gpu)):
        raise ValueError(
            f"process_group_backend={backend!r}: give 'gloo' (CPU, or GPU) or 'nccl' (needs use_gpu=True), "
            "or leave it out to choose by device."
        )
    if full_weights_home is not None and not isinstance(full_weights_home, bool):
        raise TypeError(f"full_weights_home must be True, False or None (decide by size), got {full_weights_home!r}.")


class RankPartsMixin:
    """Where each rank writes its part of a checkpoint, and whether the full weights come home."""

    # Every rank writes part of each checkpoint (the launcher stages the ranks off the driver's machine).
    every_rank_writes = True
    full_weights_home: bool | None
    _worker: Any
    _in_place = False  # save_checkpoint_in_place: every part at the path itself, not staged

    def decide_full_weights(self, trainer: pl.Trainer) -> None:
        """On the driver: whether the trained weights come home into the module (``full_weights_home``)."""
        if self.full_weights_home is not None:
            self._send_full_weights = self.full_weights_home
            return
        import psutil

        size = module_bytes(trainer.lightning_module)
        self._full_weights_budget = FULL_WEIGHTS_MEMORY_SHARE * psutil.virtual_memory().available
        # A module whose layers configure_model makes is empty here: the workers decide from its real size.
        self._send_full_weights = False if size > self._full_weights_budget else None
        if self._send_full_weights is False:
            self._warn_too_big(size)

    def _warn_too_big(self, size: float) -> None:
        self.warn(
            f"The model ({size / 2**30:.1f} GiB) is too big to bring its trained weights into the driver's process "
            "(full_weights_home=None: at most half its free memory): they stay in the checkpoints the workers "
            "write (ModelCheckpoint). Pass full_weights_home=True to bring them anyway."
        )

    def _full_weights_go_home(self, tensors: Any, scale: int = 1) -> bool:
        """In every rank (the same answer on each): whether the trained weights go to the driver. With
        ``full_weights_home=None`` the model's whole size (its tensors' global shapes after ``configure_model``,
        ``scale`` times for flat shards) against the driver's budget: no collective, every rank sees the same."""
        send = getattr(self, "_send_full_weights", True)
        if send is not None:
            return send
        size = scale * sum(math.prod(getattr(t, "ds_shape", t.shape)) * t.element_size() for t in tensors)
        self._send_full_weights = size <= self._full_weights_budget
        if not self._send_full_weights:
            self._warn_too_big(size)
        return self._send_full_weights

    def _local_checkpoint_path(self, filepath: Any) -> Path:
        """Where this rank writes or removes its part of the checkpoint rank 0 names ``filepath``."""
        worker = self._worker
        if worker is None or self._in_place:
            return Path(filepath)
        return Path(local_path(os.fspath(filepath), worker.rank_zero_staging, worker.staging_name))

    def save_checkpoint_in_place(self, trainer: pl.Trainer, location: str) -> None:
        """In every rank: ``trainer.save_checkpoint(location)`` with every part at ``location`` itself, not staged
        on its machine: for a folder every rank's machine mounts (a Tune trial's, which Tune requires)."""
        self._in_place = True
        try:
            trainer.save_checkpoint(location)
        finally:
            self._in_place = False

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.workers.storage.enabled:
            # One place every rank wrote into: rank 0 removes it, after its upload in flight.
            if self.global_rank == 0:
                location = os.fspath(filepath)
                storage.uploads().run_in_order(f"the removal of {location}", lambda: storage.remove(location))
            return
        # Every rank removes its own part (ModelCheckpoint replacing an older checkpoint).
        path = self._local_checkpoint_path(filepath)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.is_file() and self.global_rank == 0:
            path.unlink()

    @contextlib.contextmanager
    def each_rank_keeps_its_path(self) -> Iterator[None]:
        """For the block, ``broadcast`` leaves every rank its own object.

        Lightning's sharded strategies broadcast rank 0's checkpoint path before writing or reading;
        here each rank writes into its own place (a staging directory off the driver's machine) and
        reads its own copy (the launcher sends the checkpoint to every machine).
        """
        self._keep_own_objects = True
        try:
            yield
        finally:
            self._keep_own_objects = False

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if getattr(self, "_keep_own_objects", False):
            return obj
        return super().broadcast(obj, src)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # Lightning's own, with every rank writing where it must.
        path = self._local_checkpoint_path(self.broadcast(filepath))
        with self.each_rank_keeps_its_path():
            super().save_checkpoint(checkpoint, path, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        with self.each_rank_keeps_its_path():
            return super().load_checkpoint(checkpoint_path, *args, **kwargs)

    def weights_for_driver(self) -> dict[str, Any] | None:
        """In every rank (collective): the full state dict on rank 0, None elsewhere or when it stays."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if not self._full_weights_go_home(self.model.parameters(), scale=self.world_size):  # FSDP1's flat shards
            return None
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        return state if self.global_rank == 0 else None


class FullCheckpointsMixin(RankPartsMixin):
    """A strategy whose full checkpoint (restarts, Tune) is gathered on rank 0 by every rank."""

    # Recovery checkpoints (max_failures) take every rank (home.recovery).
    collective_checkpoints = True

    def full_checkpoint(self, trainer: pl.Trainer) -> dict[str, Any] | None:
        """In every rank (collective): a full checkpoint on rank 0, one file the driver keeps; None elsewhere."""
        with _lightning.sharded.full_checkpoints(self):
            checkpoint = _lightning.dump_checkpoint(trainer)
        return checkpoint if self.global_rank == 0 else None


class ShardedWorkersMixin(FullCheckpointsMixin):
    """Checkpoints, loading and the weights home of a strategy whose ranks hold DTensor shards (FSDP2, TP)."""

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        _lightning.sharded.evaluate_under_no_grad(trainer)
        super().setup(trainer)  # type: ignore[misc]

    @override
    def weights_for_driver(self) -> list[WeightPart] | None:
        """In every rank: the shards this rank sends the driver, which puts them in place (no all-gather).

        A shard replicated over part of the mesh is sent by one rank of it. A layout other than plain
        ``Shard``/``Replicate`` placements (FSDP over tensor parallelism on one dimension) is gathered:
        every rank takes the same path, since placements are the same on every rank.
        """
        from torch.distributed.tensor import DTensor

        state = self.model.state_dict()
        if not self._full_weights_go_home(state.values()):
            return None
        parts = []
        for name, value in state.items():
            if not isinstance(value, DTensor):
                if self.global_rank == 0:
                    parts.append(WeightPart(name, value))
                continue
            layout = shard_layout(value)
            if layout is None:
                full = value.full_tensor()  # collective
                if self.global_rank == 0:
                    parts.append(WeightPart(name, full))
            elif layout[1]:
                parts.append(WeightPart(name, value.to_local(), tuple(value.shape), layout[0]))
        return parts

    def save_sharded_checkpoint(self, checkpoint: dict[str, Any], path: Path) -> None:
        """Each rank writes its shard (torch.distributed.checkpoint) into ``path``; rank 0 the rest (``meta.pt``)."""
        import torch.distributed.checkpoint as dcp

        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        converted = {"state_dict": checkpoint.pop("state_dict")}
        for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            converted[f"optimizer_{index}"] = optimizer_state
        dcp.save(converted, checkpoint_id=path)
        if self.global_rank == 0:
            torch.save(checkpoint, path / _lightning.sharded.metadata_filename(self.namespace))

    def checkpoint_to_storage(self, trainer: pl.Trainer, folder: str, complete: Callable[[str], None]) -> None:
        """A recovery checkpoint into ``folder`` (collective): each rank writes its own shards, in the background;
        ``complete(folder)`` runs in rank 0 once every rank's are written. Never gathered on one rank."""
        with _lightning.sharded.sharded_checkpoints(self):
            checkpoint = _lightning.dump_checkpoint(trainer)
        self._save_sharded_in_background(checkpoint, folder, complete)

    def _save_sharded_in_background(
        self, checkpoint: dict[str, Any], location: str, complete: Callable[[str], None] | None = None
    ) -> None:
        """torch's distributed checkpoint into ``location`` (a URL or a mounted directory), staged in memory on this
        thread and written beside training over a process group of its own; rank 0 then writes the rest (meta.pt)."""
        import torch.distributed.checkpoint as dcp

        converted = {"state_dict": checkpoint.pop("state_dict")}
        for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            converted[f"optimizer_{index}"] = optimizer_state
        metadata = storage.join(location, _lightning.sharded.metadata_filename(self.namespace))
        rank_zero = self.global_rank == 0

        def start() -> Callable[[], None]:
            rest = storage.serialize(checkpoint) if rank_zero else None
            future = dcp.async_save(converted, checkpoint_id=location, process_group=self._upload_group())

            def job() -> None:
                future.result()  # in rank 0: every rank's shards are written
                if rest is not None:
                    storage.write_bytes(metadata, rest)
                    if complete is not None:
                        complete(location)

            return job

        storage.uploads().submit(location, start)

    def _upload_group(self) -> Any:
        """A gloo process group for the uploads' collectives, apart from training's (made once, by every rank)."""
        if getattr(self, "_uploads_group", None) is None:
            self._uploads_group = torch.distributed.new_group(backend="gloo")
        return self._uploads_group

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options.")
        if self.workers.storage.enabled:
            location = os.fspath(self.broadcast(filepath))
            if _lightning.sharded.saves_sharded_checkpoints(self):
                self._save_sharded_in_background(checkpoint, location)
            elif self.global_rank == 0:
                self.checkpoint_io.save_checkpoint(checkpoint, location)  # in the background (home.background_io)
            return
        path = self._local_checkpoint_path(self.broadcast(filepath))
        if _lightning.sharded.saves_sharded_checkpoints(self):
            self.save_sharded_checkpoint(checkpoint, path)
            return
        if path.is_dir():
            shutil.rmtree(path)  # a sharded checkpoint of the same name, saved before
        if self.global_rank == 0:
            self.checkpoint_io.save_checkpoint(checkpoint, path)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # Each rank reads its own copy of the file or directory (the launcher ships it to every machine):
        # no broadcast of rank 0's path. The optimizers are loaded only when fitting.
        fitting = self.lightning_module.trainer.state.fn == namespaces.FITTING
        optimizers = {f"optimizer_{i}": optimizer for i, optimizer in enumerate(self.optimizers)} if fitting else {}
        weights_only = kwargs.get("weights_only", args[0] if args else None)
        strict = self.lightning_module.strict_loading
        location = os.fspath(checkpoint_path)
        if self.workers.storage.enabled:
            storage.uploads().wait()  # it may be one this rank is still writing
        if not is_local(location):
            return self._load_from_url(location, optimizers, strict, weights_only)
        state = {"state_dict": self.model, **optimizers}
        return _lightning.sharded.load_checkpoint(self.namespace, Path(location), state, strict, weights_only)

    def _load_from_url(self, url: str, optimizers: dict[str, Any], strict: bool, weights_only: Any) -> dict[str, Any]:
        """A sharded checkpoint folder in storage: each rank reads the parts of the shards it holds (any number of
        ranks may have saved it). A full file is read into a local copy first."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultLoadPlanner
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        fs, path = storage.filesystem(url)
        if not fs.isdir(path):
            with tempfile.TemporaryDirectory(prefix="ray_lightning-ckpt-") as directory:
                local = os.path.join(directory, os.path.basename(path))
                fs.get_file(path, local)
                state = {"state_dict": self.model, **optimizers}
                return _lightning.sharded.load_checkpoint(self.namespace, Path(local), state, strict, weights_only)
        options = StateDictOptions(strict=strict)
        state = {"state_dict": get_model_state_dict(self.model)}
        state.update({k: get_optimizer_state_dict(self.model, o) for k, o in optimizers.items()})
        dcp.load(state, checkpoint_id=url, planner=DefaultLoadPlanner(allow_partial_load=not strict))
        set_model_state_dict(self.model, state["state_dict"], options=options)
        for key, optimizer in optimizers.items():
            set_optimizer_state_dict(self.model, optimizer, state[key], options=options)
        with fs.open(f"{path}/{_lightning.sharded.metadata_filename(self.namespace)}", "rb") as f:
            return torch.load(f, weights_only=bool(weights_only), map_location="cpu")


def shard_layout(tensor: Any) -> tuple[tuple[tuple[int, int], ...], bool] | None:
    """Where this rank's local part of a DTensor lies in the full tensor, and whether this rank sends it.

    None for placements other than ``Shard``/``Replicate`` with each tensor dimension sharded at most
    once. Sharding splits a dimension as ``torch.chunk`` does (DTensor's and FSDP2's rule); of the
    ranks holding the same part (replicated over a mesh dimension), the one at coordinate 0 sends it.
    """
    from torch.distributed.tensor import Replicate, Shard

    mesh, shape = tensor.device_mesh, tuple(tensor.shape)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    bounds = [(0, n) for n in shape]
    sharded: set[int] = set()
    sends = True
    for mesh_dim, placement in enumerate(tensor.placements):
        if type(placement) is Replicate:
            sends = sends and coordinate[mesh_dim] == 0
            continue
        if type(placement) is not Shard or placement.dim in sharded:
            return None
        dim = placement.dim
        sharded.add(dim)
        size = -(-shape[dim] // mesh.size(mesh_dim))
        start = min(coordinate[mesh_dim] * size, shape[dim])
        bounds[dim] = (start, min(start + size, shape[dim]))
    local = tuple(tensor.to_local().shape)
    if local != tuple(stop - start for start, stop in bounds):
        raise RuntimeError(f"A shard of shape {local} does not fit where torch.chunk puts it: {bounds} of {shape}.")
    return tuple(bounds), sends
