"""After a worker died: the driver's choice of the survivor whose memory the restart goes on from.

The survivors of a replicated fit (DDP, Horovod) each hold the state after the last step they completed
(:mod:`ray_lightning.home.snapshot`). :func:`take` asks each for the step it holds, picks the one furthest
on (all hold the same state when they completed the same steps; one may be a step ahead when the peer
died between two ranks' all-reduces), and has it put its state into its node's object store. The restarted
ranks read it from there as their ``ckpt_path`` (:func:`ray_lightning.launch.call_record.attempt_checkpoint`).

Growth law: one small call to each survivor, one to the source; the driver receives a header per survivor
(a few KiB: the step, the random generators) and one reference. No byte of the state passes through it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray

from ray_lightning.home import snapshot
from ray_lightning.home.snapshot import SnapshotHeader
from ray_lightning.runtime import CheckpointFile

log = logging.getLogger(__name__)

# Bounds on a survivor's answer (it came out of its call: the answer is immediate) and on the source's
# serialization of its state (``torch.save`` into memory: about a second per GB).
HEADER_TIMEOUT_S = 10.0
SHARE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class InMemory:
    """The state a restart goes on from: where it is (``file``, a reference its owner ``source`` holds) and what."""

    header: SnapshotHeader
    file: CheckpointFile
    source: Any  # the survivor's actor that owns the reference


def take(survivors: list[Any], attempt: int, newer_than: int | None) -> tuple[InMemory | None, int | None]:
    """The survivors' newest state from attempt ``attempt`` when it is at least at step ``newer_than`` (the newest
    recovery checkpoint's; None: there is none), and the furthest step any survivor reached (None: unknown)."""
    headers = _headers(survivors, attempt)
    reached = max((h.global_step for h, _ in headers), default=None)
    held = [(h, actor) for h, actor in headers if h.held]
    if not held:
        return None, reached
    header, actor = max(held, key=lambda pair: pair[0].global_step)
    if newer_than is not None and header.global_step < newer_than:
        return None, reached
    try:
        (reference,) = ray.get(actor.share_snapshot.remote(), timeout=SHARE_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - the source died or stalled: the restart reads the checkpoint
        log.warning("ray_lightning: a survivor could not share its state (%s); resuming from the checkpoint.", error)
        return None, reached
    return InMemory(header, CheckpointFile(snapshot.file_name(header.global_step), reference), actor), reached


def _headers(survivors: list[Any], attempt: int) -> list[tuple[SnapshotHeader, Any]]:
    refs = [actor.snapshot_header.remote() for actor in survivors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=HEADER_TIMEOUT_S)
    found = []
    for actor, ref in zip(survivors, refs):
        if ref not in ready:
            continue
        try:
            header = ray.get(ref)
        except Exception:  # noqa: BLE001 - it died after coming out of the call: it is not a source
            continue
        if header is not None and header.attempt == attempt:
            found.append((header, actor))
    return found
