"""Benchmarks: ray_lightning's strategies against Lightning's own DDP and Ray Train, on one workload.

``python -m benchmarks.run`` (see ``benchmarks/README.md``) measures every contender in fresh
driver processes and writes a markdown and a JSON table. Here: what every benchmark's processes share and may
import cheaply (json and os only: Ray Data's worker processes import the data benchmark's rows).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import asdict, fields
from typing import Any


def write_whole(path: str, record: Any, indent: int | None = None) -> None:
    """``record`` as JSON at ``path``, whole or not at all: a reader never sees half a file."""
    with open(path + ".partial", "w") as f:
        json.dump(record, f, indent=indent)
    os.replace(path + ".partial", path)


def read_ranks(prefix: str) -> dict[int, dict[str, Any]]:
    """Every rank's file ``<prefix>.rank<N>.json``, by rank."""
    records = {}
    for path in glob.glob(f"{prefix}.rank*.json"):
        with open(path) as f:
            record = json.load(f)
        records[record["rank"]] = record
    return records


class JsonSpec:
    """A dataclass of sizes sent as JSON to each driver process (fields it does not know are left out)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, text: str) -> Any:
        data = json.loads(text)
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})  # type: ignore[arg-type]
