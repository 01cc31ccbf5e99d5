"""Every private Ray name of this folder, with where Ray keeps it (:data:`PRIVATE_NAMES`).

``tests/test_ray_internals.py`` checks each still exists (connected to Ray: the GCS client exists
only then) and names any that moved; it also checks that the autoscaler's keys (:mod:`.kv`) are
still the ones Ray names, and its monitor scripts (:mod:`.state`) still where Ray keeps them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ray_lightning._ray.data import DATASET, EXCLUDE_RESOURCES, EXECUTION_OPTIONS, META_COUNT, REF_BUNDLES
from ray_lightning._ray.kv import INTERNAL_KV, RAY_KEY_NAMES
from ray_lightning._ray.logs import CONSTANTS, DISPATCHER, WORKER
from ray_lightning._ray.state import AUTOSCALER_PB2, GLOBAL_STATE, UP_NODE_STATUSES
from ray_lightning._ray.tune import DIR_NAME, GET_SESSION, SESSION, STORAGE, STORAGE_CONTEXT
from ray_lightning._torch.private import PrivateName

_STREAMS = "global_worker_stdstream_dispatcher"
# (module, the names on it we use; a dotted name is a path of attributes).
ON_MODULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (DISPATCHER, (_STREAMS, f"{_STREAMS}._lock", f"{_STREAMS}.handlers")),
    (
        WORKER,
        (
            "_should_ignore_worker_log_prefix",
            "global_worker",
            "print_worker_logs",
            "stdout_deduplicator.flush",
            "stderr_deduplicator.flush",
            "global_worker.gcs_client.get_cluster_status",  # set when the process connects to Ray
        ),
    ),
    (CONSTANTS, ("LOG_PREFIX_ACTOR_NAME",)),
    (GLOBAL_STATE, ("state.get_draining_nodes", "state.get_cluster_config")),
    (INTERNAL_KV, ("_internal_kv_get", "_internal_kv_put", "_internal_kv_del")),
    # A DeveloperAPI and a deprecated option, not private: listed so that a release without them is named.
    (DATASET, (f"Dataset.{META_COUNT}", f"Dataset.{REF_BUNDLES}")),
    (EXECUTION_OPTIONS, (f"ExecutionOptions.{EXCLUDE_RESOURCES}",)),
    (SESSION, (GET_SESSION,)),  # its result's .storage is a trial's StorageContext (a DeveloperAPI)
    (STORAGE, (f"{STORAGE_CONTEXT}.{DIR_NAME}",)),
    (AUTOSCALER_PB2, ("GetClusterStatusReply", *(f"NodeStatus.{status}" for status in UP_NODE_STATUSES))),
    # Where Ray names the keys kv.py uses (their values are checked too).
    *((module, (name,)) for module, name in sorted(set(RAY_KEY_NAMES.values()))),
)


def _module(path: str) -> Callable[[], Any]:
    return lambda: importlib.import_module(path)


PRIVATE_NAMES: tuple[PrivateName, ...] = tuple(
    PrivateName(module, name, _module(module)) for module, names in ON_MODULES for name in names
)
