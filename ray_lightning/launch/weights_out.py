"""The module's weights on their way to the workers: beside the payload's pickle, in chunks.

Pickling a module copies every tensor's bytes twice in the driver (torch serializes each storage
to bytes, which the pickle stream copies again) before Ray writes the stream into the object store:
for a big model, two extra models in the driver's memory at launch. So the payload carries
placeholders instead (a one-element tensor expanded to the shape: a few bytes), and the weights go
into the object store as packed chunks (:mod:`ray_lightning.home.weights`), written straight from
the module's memory one chunk at a time, whose pages then leave the driver's resident memory. Each
worker copies them into its unpickled module (:func:`take_weights`); pickle keeps object identity,
so parameters shared between modules (tied weights) stay shared.

Only CPU tensors of at least :data:`ASIDE_BYTES` that own their whole storage are set aside; views
into a larger storage, other devices, tensor subclasses and small tensors are pickled as before.
Decision: another tensor object that views a set-aside tensor's memory (``p.data`` or a
``state_dict()`` kept by a callback) arrives as its own copy instead of sharing the parameter's memory,
as a plain pickle would have it; modules, optimizers-to-be and tied parameters hold the parameter
objects themselves, which stay shared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import ray
import torch

from ray_lightning.home.weights import WeightPart, pack_in_chunks, read_parts, release_pages, unpack
from ray_lightning.launch.session import driver_node_id

# Below this a tensor's pickle costs nothing worth a chunk of its own.
ASIDE_BYTES = 1 << 20


@dataclass
class WeightsAside:
    """The tensors whose data travels in ``chunks`` (placeholders when pickled; part ``i`` is ``tensors[i]``)."""

    tensors: list[torch.Tensor]
    chunks: list[ray.ObjectRef]


def _set_aside(tensor: Any) -> bool:
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        and tensor.numel() * tensor.element_size() >= ASIDE_BYTES
    )


def _tensors_of(objects: Iterable[Any]) -> list[torch.Tensor]:
    found: dict[int, torch.Tensor] = {}
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for tensor in [*obj.parameters(), *obj.buffers()]:
                if _set_aside(tensor):
                    found.setdefault(id(tensor), tensor)
    return list(found.values())


@contextlib.contextmanager
def weights_aside(objects: Iterable[Any]) -> Iterator[WeightsAside | None]:
    """While inside: the big tensors of the modules among ``objects`` are placeholders, their data in chunks.

    The modules get their own tensors back on exit, also when pickling failed.
    """
    tensors = _tensors_of(objects)
    if not tensors:
        yield None
        return
    chunks = []
    # A Ray Client's puts go over the network into the cluster's store: nothing of it is mapped here.
    in_the_store = driver_node_id() is not None
    for chunk in pack_in_chunks(WeightPart(str(i), t) for i, t in enumerate(tensors)):
        ref = ray.put(chunk)
        del chunk
        if in_the_store:
            # The pages this process wrote into the store: read back in place (no copy) to let them go.
            release_pages([part.value.data for part in ray.get(ref)])
        chunks.append(ref)
    saved = [t.data for t in tensors]
    try:
        for tensor in tensors:
            tensor.data = torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)
        yield WeightsAside(tensors, chunks)
    finally:
        for tensor, data in zip(tensors, saved):
            tensor.data = data


def take_weights(aside: WeightsAside | None) -> None:
    """In a worker, after unpickling the payload: give the set-aside tensors memory and their data."""
    if aside is None:
        return
    for tensor in aside.tensors:
        tensor.data = torch.empty(tensor.shape, dtype=tensor.dtype)
    with torch.no_grad():
        for part in read_parts(aside.chunks):
            aside.tensors[int(part.name)].data.copy_(unpack(part.value))
