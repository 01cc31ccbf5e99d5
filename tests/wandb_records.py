"""Read an offline W&B run file (``run-<id>.wandb``) with W&B's own protobuf records.

wandb 0.31 no longer ships a Python reader (``wandb.sdk.internal.datastore``); the format is
unchanged: a 7-byte header ``<4sHB`` (``b":W&B"``, 0xBEE1, 0), then 32 KiB blocks of chunks, each
with a 7-byte header ``<IHB`` (crc, length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4); a block's tail
shorter than a header is padding.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str) -> Iterator[Any]:
    """The ``wandb_internal_pb2.Record`` messages of one ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert struct.unpack("<4sHB", data[:HEADER]) == (b":W&B", 0xBEE1, 0), f"{path} is no W&B run file"
    position, pending = HEADER, b""
    while position + HEADER <= len(data):
        space = BLOCK - position % BLOCK
        if space < HEADER:
            position += space
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        if kind == 0 and length == 0:
            break
        chunk = data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        if kind in (FIRST, MIDDLE):
            pending += chunk
            continue
        message, pending = pending + chunk, b""
        record = wandb_internal_pb2.Record()
        record.ParseFromString(message)
        yield record


@dataclass
class OfflineRun:
    """What one offline run directory holds."""

    path: str
    run_id: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False  # the run file ends with the run's exit record

    def values(self, key: str) -> list[tuple[int, Any]]:
        """``(trainer/global_step, value)`` of every history row that has ``key``."""
        return [(row.get("trainer/global_step"), row[key]) for row in self.history if key in row]


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(path: str) -> OfflineRun:
    run = OfflineRun(path)
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id = record.run.run_id
            run.config.update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run.config.update({_key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            run.history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "artifact":
            artifact = record.artifact
            run.artifacts.append({"name": artifact.name, "type": artifact.type, "aliases": list(artifact.aliases)})
        elif kind == "exit":
            run.finished = True
    return run


def offline_runs(save_dir: str, run_id: str) -> list[OfflineRun]:
    """Every offline run directory of ``run_id`` under ``save_dir/wandb``, oldest first."""
    pattern = os.path.join(save_dir, "wandb", f"offline-run-*-{run_id}*", f"run-{run_id}.wandb")
    return [read_run(p) for p in sorted(glob.glob(pattern))]
