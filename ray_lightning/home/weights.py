"""Trained weights on their way home: packed as numpy byte arrays, in chunks the driver pulls one at a time.

A worker that holds weights for the driver (rank 0; every rank of a sharded strategy, each with
its own shards) describes them as :class:`WeightPart` s: a state-dict entry, or the block of one
that this rank holds (``index``) of a tensor of ``full_shape``. :func:`pack_in_chunks` packs them
into chunks of about :data:`CHUNK_BYTES`, which stay in the worker; the driver asks for them one
after the other (``RayWorker.weights_chunk``, a few in flight) and copies each into its module
before it lets it go (:func:`load_chunks`). So the driver's memory holds its module and a few
chunks, never a second model, and sharded weights need no all-gather: each rank sends its shards
and the driver puts them in place.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import ray
import torch

from ray_lightning import namespaces

# (start, stop) along each dimension of the full tensor; None: the whole entry.
Index = tuple[tuple[int, int], ...] | None
# Big enough that a chunk's overhead (an actor call) is nothing next to its copy; small next to a model.
CHUNK_BYTES = 32 * 2**20


@dataclass(frozen=True)
class WeightPart:
    """A state-dict entry ``name``, or the block ``index`` of it (a tensor of ``full_shape``) one rank holds."""

    name: str
    value: Any
    full_shape: tuple[int, ...] | None = None
    index: Index = None

    def region(self, target: torch.Tensor) -> torch.Tensor:
        """The part of the full tensor ``target`` this part fills."""
        if self.index is None:
            return target
        return target[tuple(slice(start, stop) for start, stop in self.index)]


def module_bytes(module: torch.nn.Module | None) -> int:
    """The bytes of a module's parameters and buffers as this process holds them (0 for none)."""
    if module is None:
        return 0
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def parts_of(state_dict: dict[str, Any]) -> list[WeightPart]:
    """A full state dict (rank 0's) as parts."""
    return [WeightPart(name, value) for name, value in state_dict.items()]


def pack(value: Any) -> Any:
    """A tensor as numpy bytes, which Ray moves without extra copies; anything else on the CPU.

    Ray pickles a torch tensor into its message as bytes, then copies that into the object store,
    and the driver copies it out again. A numpy array goes into the object store with one copy and
    is read there in place. Bytes (``uint8``) keep every dtype, including those numpy lacks
    (bfloat16, float8).
    """
    if isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_quantized:
        tensor = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
        return _PackedTensor(tensor.dtype, tuple(tensor.shape), tensor.reshape(-1).view(torch.uint8).numpy())
    return namespaces.to_cpu(value)


def unpack(value: Any) -> Any:
    """A packed tensor as a tensor viewing its bytes (no copy); anything else as it is."""
    if not isinstance(value, _PackedTensor):
        return value
    with warnings.catch_warnings():
        # The bytes may be the object store's read-only memory: they are copied from, never written.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return value.tensor()


def pack_in_chunks(parts: Iterable[WeightPart], chunk_bytes: int = CHUNK_BYTES) -> list[list[WeightPart]]:
    """``parts`` packed (:func:`pack`) and grouped into chunks of about ``chunk_bytes`` each."""
    chunks: list[list[WeightPart]] = [[]]
    size = 0
    for part in parts:
        packed = WeightPart(part.name, pack(part.value), part.full_shape, part.index)
        if size >= chunk_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(packed)
        size += packed.value.data.nbytes if isinstance(packed.value, _PackedTensor) else 0
    return chunks if chunks[0] else []


def load_chunks(module: torch.nn.Module | None, chunks: Iterable[Any]) -> None:
    """Copy every chunk (a list of packed parts, or a reference to one) into ``module``, one chunk in memory at a time.

    Parameters and buffers are copied into in place. Entries the module lacks as a tensor of that
    shape (layers added in the workers' setup hooks, parameters on the meta device after
    ``empty_init``) are assembled in new tensors and assigned at the end; other values (extra state)
    are loaded as they are. Non-strict, like Lightning's ``ddp_spawn``.
    """
    own: dict[str, Any] | None = None
    assembled: dict[str, torch.Tensor] = {}
    others: dict[str, Any] = {}
    for part in read_parts(chunks):
        if own is None:
            own = dict(module.state_dict(keep_vars=True))
        value = unpack(part.value)
        if not isinstance(value, torch.Tensor):
            others[part.name] = value
            continue
        shape = part.full_shape or tuple(value.shape)
        target = own.get(part.name)
        if not _fits(target, shape):
            target = assembled.get(part.name)
            if target is None:
                target = assembled[part.name] = torch.empty(shape, dtype=value.dtype)
        with torch.no_grad():
            part.region(target.data).copy_(value)
    if assembled or others:
        module.load_state_dict({**assembled, **others}, strict=False, assign=bool(assembled))


def read_parts(chunks: Iterable[Any]) -> Iterator[WeightPart]:
    """The parts of every chunk (a list of parts, or a reference to one), a chunk at a time.

    The caller copies each part before asking for the next; once a chunk's parts are copied, its
    object-store pages leave this process's memory (:func:`release_pages`) and the chunk goes.
    """
    for chunk in chunks:
        parts = ray.get(chunk) if isinstance(chunk, ray.ObjectRef) else chunk
        del chunk
        yield from parts
        release_pages([p.value.data for p in parts if isinstance(p.value, _PackedTensor)])
        del parts


_MADV_DONTNEED = 4
_BIG_ENOUGH_TO_RELEASE = 1 << 20


def release_pages(arrays: Iterable[Any]) -> None:
    """Drop from this process's resident memory the object-store pages these numpy arrays view (Linux).

    Why: pages of the object store a process wrote or read stay in its resident set until it unmaps
    them, although they are the store's memory (shared, counted once on the machine). A driver that
    read a model's chunks would show a second model in its RSS, which is what memory limits,
    OOM killers and users look at. ``madvise(MADV_DONTNEED)`` on a shared mapping only drops the
    process's mapping of the pages; the data stays in the store and is read again on the next touch.
    Only whole pages inside arrays of at least 1 MB that lie in a shared mapping (``/proc/self/maps``)
    are released, so nothing private is ever touched.
    """
    if not sys.platform.startswith("linux"):
        return
    ranges = []
    for array in arrays:
        if array.nbytes < _BIG_ENOUGH_TO_RELEASE or array.flags.writeable:
            continue  # writable: the process's own memory, not the store's
        start = array.ctypes.data
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        last = (start + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            ranges.append((first, last))
    if not ranges:
        return
    shared = _shared_mappings()
    for first, last in ranges:
        if any(lo <= first and last <= hi for lo, hi in shared):
            _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def _shared_mappings() -> list[tuple[int, int]]:
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) > 1 and fields[1][3:4] == "s":
                    lo, hi = fields[0].split("-")
                    found.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return found


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _fits(target: Any, shape: tuple[int, ...]) -> bool:
    # A dtype that differs is cast, as load_state_dict does (a bf16-true run into a float32 module).
    return isinstance(target, torch.Tensor) and not target.is_meta and tuple(target.shape) == shape


@dataclass(frozen=True)
class _PackedTensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    data: Any  # a 1-D numpy uint8 array

    def tensor(self) -> torch.Tensor:
        if self.data.size == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.from_numpy(self.data).view(self.dtype).reshape(self.shape)
