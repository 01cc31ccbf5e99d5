"""The preprocessing functions of tests/test_data.py's datasets, which run as Ray Data tasks.

Ray pickles a module's functions by reference, so each task process imports the module that defines them: here
only numpy and the standard library, not the test module (torch, Lightning, ray_lightning: seconds of CPU in
every task process, most of a small dataset's time on 2 cores), as a user's pipeline module imports what it uses.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np


def features(batch: dict) -> dict:
    """The preprocessing: two features per row from its id, and the node that computed it."""
    import ray

    ids = batch["id"].astype(np.float32)
    batch["x"] = np.stack([ids / 100.0, (ids % 7) / 7.0], axis=1)
    batch["node"] = np.array([ray.get_runtime_context().get_node_id()] * len(ids))
    return batch


def stamped(batch: dict, out: str, pause_s: float = 0.0) -> dict:
    """``features``, and a line per block in ``<out>/blocks.jsonl`` (its first id, rows, and when it was done).
    ``pause_s``: work that makes a block take that long."""
    if pause_s:
        time.sleep(pause_s)
    batch = features(batch)
    with open(os.path.join(out, "blocks.jsonl"), "a") as f:
        f.write(json.dumps({"first": int(batch["id"][0]), "rows": len(batch["id"]), "at": time.time()}) + "\n")
    return batch
