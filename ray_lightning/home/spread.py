"""A recovery checkpoint of a replicated fit (DDP: every rank holds the whole state), written by every rank, a part
each, instead of by rank 0 alone.

The weights (the module's parameters) and the optimizers' states are the same in every rank, so they are dealt
over the ranks, largest first onto the rank with the fewest bytes so far: each rank copies (on the training
thread) and writes (beside it) only its own part, ``part-<rank>.pt``. Rank 0 also writes the rest,
``skeleton.pt``: the checkpoint with those tensors left out (buffers such as BatchNorm's running statistics,
which each rank updates with its own batch, stay rank 0's, as in a one-file checkpoint). Once every rank's part is
written (a barrier over a gloo group of its own, in the upload thread), rank 0 completes the checkpoint.

A restart reads the skeleton and every part (each rank needs the whole state), whatever the new world size.

Growth law: per checkpoint, each rank copies and writes ``state / world_size`` bytes (rank 0 also the skeleton,
the buffers and a few KB); before, rank 0 copied and wrote the whole state and the others nothing. Reading is
unchanged: every rank reads the whole state once. Horovod's ranks have no torch process group for the barrier;
their rank 0 writes the whole checkpoint, as before.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Callable
from typing import Any

import torch

from ray_lightning.home import storage

SKELETON = "skeleton.pt"
_PART = "part-{rank}.pt"

Path = tuple[Any, ...]  # keys and list indices from the checkpoint's top


def applies(trainer: Any) -> bool:
    """Whether this fit's recovery checkpoints are spread: a replicated state, 2+ ranks, a torch process group."""
    strategy = trainer.strategy
    return (
        getattr(strategy, "state_in_every_rank", False)
        and getattr(strategy, "full_checkpoint", None) is None
        and trainer.world_size > 1
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
    )


def _shared_paths(checkpoint: dict[str, Any], parameter_names: set[str]) -> list[Path]:
    """The tensors every rank holds alike: the module's parameters and every tensor of the optimizers' states."""
    paths: list[Path] = [("state_dict", name) for name in checkpoint.get("state_dict", {}) if name in parameter_names]

    def walk(value: Any, path: Path) -> None:
        if isinstance(value, torch.Tensor):
            paths.append(path)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, (*path, key))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                walk(item, (*path, index))

    walk(checkpoint.get("optimizer_states", []), ("optimizer_states",))
    return paths


def _get(value: Any, path: Path) -> Any:
    for key in path:
        value = value[key]
    return value


def deal(sizes: list[int], world_size: int) -> list[int]:
    """The rank each tensor goes to: largest first, onto the rank with the fewest bytes so far (ties: lowest rank).
    The same in every rank, since every rank deals the same sizes."""
    owner = [0] * len(sizes)
    load = [0] * world_size
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += sizes[index]
    return owner


def _without(checkpoint: dict[str, Any], paths: list[Path]) -> dict[str, Any]:
    """A copy of ``checkpoint`` with None at ``paths`` and every other tensor copied to CPU memory."""
    taken = set(paths)

    def copy(value: Any, path: Path) -> Any:
        if path in taken:
            return None
        if isinstance(value, dict):
            copied = {key: copy(item, (*path, key)) for key, item in value.items()}
            return copied if type(value) is dict else type(value)(copied)  # an OrderedDict stays one
        if isinstance(value, list):
            return [copy(item, (*path, index)) for index, item in enumerate(value)]
        return storage.snapshot(value)

    return copy(checkpoint, ())


def _group(strategy: Any) -> Any:
    """A gloo process group for the parts' barrier, apart from training's: made by every rank together, once per
    process group (a restart from memory re-forms the group in the same processes, with a new peer)."""
    world = torch.distributed.group.WORLD
    made = getattr(strategy, "_spread_group", None)
    if made is None or made[0] is not world:
        strategy._spread_group = (world, torch.distributed.new_group(backend="gloo"))
    return strategy._spread_group[1]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _alike(listing: list[Any], group: Any) -> bool:
    """Whether every rank has the same ``listing`` (a digest of it gathered from each: a few bytes per rank)."""
    digest = hashlib.sha1(repr(listing).encode()).hexdigest()
    digests: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(digests, digest, group=group)
    return len(set(digests)) == 1


def write(trainer: Any, folder: str, complete: Callable[[str], None]) -> None:
    """In every rank, on the training thread: copy this rank's part and have the upload thread write it; rank 0
    also the skeleton, and it calls ``complete(folder)`` once every rank's part is written."""
    from ray_lightning import _lightning

    checkpoint = _lightning.dump_checkpoint(trainer)
    names = {name for name, _ in trainer.lightning_module.named_parameters()}
    group = _group(trainer.strategy)
    sizes = {path: _nbytes(_get(checkpoint, path)) for path in _shared_paths(checkpoint, names)}
    rank, world_size = trainer.global_rank, trainer.world_size

    def start() -> Callable[[], None]:
        # Here, after this rank's previous upload ended (Uploads.submit): the group's collectives never overlap a
        # job's. The gathering also waits for rank 0's previous completion, which removes every other folder of
        # the run's recovery checkpoints (this one's parts, were they written before it).
        shared = list(sizes)
        if not _alike([(path, size) for path, size in sizes.items() if path[0] == "optimizer_states"], group):
            # An optimizer that shards its state (ZeroRedundancyOptimizer) gives it to rank 0 alone: rank 0 writes it.
            shared = [path for path in shared if path[0] != "optimizer_states"]
        owner = deal([sizes[path] for path in shared], world_size)
        mine = [path for path, holder in zip(shared, owner) if holder == rank]
        part = {
            "paths": [list(path) for path in mine],
            "tensors": [storage.snapshot(_get(checkpoint, path)) for path in mine],
        }
        skeleton = _without(checkpoint, shared) if rank == 0 else None

        def job() -> None:
            storage.save_checkpoint(storage.join(folder, _PART.format(rank=rank)), part)
            if skeleton is not None:
                storage.save_checkpoint(storage.join(folder, SKELETON), {**skeleton, "spread_over": world_size})
            torch.distributed.barrier(group=group)  # every rank's part is written
            if rank == 0:
                complete(folder)

        return job

    storage.uploads().submit(folder, start)


def is_spread(location: Any) -> bool:
    """Whether ``location`` (a path or URL) is a folder this module wrote."""
    try:
        fs, path = storage.filesystem(str(location))
        return fs.exists(posixpath.join(path, SKELETON))
    except Exception:  # noqa: BLE001 - a location no filesystem here knows (a checkpoint held in memory)
        return False


def load(location: str, load_file: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """The whole checkpoint from a spread folder: the skeleton read with ``load_file`` (the strategy's own
    checkpoint IO), every part's tensors put back in place."""
    checkpoint = load_file(storage.join(str(location), SKELETON))
    for rank in range(checkpoint.pop("spread_over")):
        fs, path = storage.filesystem(storage.join(str(location), _PART.format(rank=rank)))
        with fs.open(path, "rb") as f:
            part = torch.load(f, map_location="cpu", weights_only=True)
        for key_path, tensor in zip(part["paths"], part["tensors"]):
            _get(checkpoint, key_path[:-1])[key_path[-1]] = tensor
    return checkpoint
