"""Trained weights on their way home: numpy byte arrays, which Ray moves with the fewest copies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
