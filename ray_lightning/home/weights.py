"""Trained weights on their way home: numpy byte arrays, which Ray moves with the fewest copies, in chunks.

Rank 0 puts the weights into the object store in chunks of about :data:`CHUNK_BYTES`
(:func:`put_in_chunks`); the driver copies one chunk at a time into its module and lets it go
before reading the next, so its memory holds the module plus one chunk, not a second model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
import torch

from ray_lightning import namespaces


def pack_weights(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state dict made of numpy byte arrays, which Ray moves without extra copies.

    Ray pickles a torch tensor into the message as bytes, then copies that into the object store,
    and the driver copies it out again. A numpy array instead goes into the object store with one
    copy and is read there in place by the driver, so the only other copy is ``load_state_dict``'s.
    Bytes (``uint8``) keep every dtype, including those numpy lacks (bfloat16, float8).
    """
    packed: dict[str, Any] = {}
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_quantized:
            tensor = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
            data = tensor.reshape(-1).view(torch.uint8).numpy()
            packed[name] = _PackedTensor(tensor.dtype, tuple(tensor.shape), data)
        else:
            packed[name] = namespaces.to_cpu(value)
    return packed


# Big enough that a chunk's overhead (a put, a get) is nothing next to its copy; small next to a model.
CHUNK_BYTES = 64 * 2**20


def put_in_chunks(state_dict: dict[str, Any], chunk_bytes: int = CHUNK_BYTES) -> list[Any]:
    """References to :func:`pack_weights` of ``state_dict``, a chunk of about ``chunk_bytes`` each."""
    chunks: list[Any] = []
    current: dict[str, Any] = {}
    size = 0
    for name, value in pack_weights(state_dict).items():
        current[name] = value
        size += value.data.nbytes if isinstance(value, _PackedTensor) else 0
        if size >= chunk_bytes:
            chunks.append(ray.put(current))
            current, size = {}, 0
    if current or not chunks:
        chunks.append(ray.put(current))
    return chunks


def read_chunk(chunk: Any) -> dict[str, Any]:
    """A chunk's state dict (tensors viewing the object store's memory): a reference's, or one given inline."""
    return unpack_weights(ray.get(chunk) if isinstance(chunk, ray.ObjectRef) else chunk)


def unpack_weights(packed: dict[str, Any]) -> dict[str, Any]:
    """Tensors viewing :func:`pack_weights`' arrays (no copy)."""
    return {name: value.tensor() if isinstance(value, _PackedTensor) else value for name, value in packed.items()}


@dataclass(frozen=True)
class _PackedTensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    data: Any  # a 1-D numpy uint8 array

    def tensor(self) -> torch.Tensor:
        if self.data.size == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.from_numpy(self.data).view(self.dtype).reshape(self.shape)
