"""Ray's internal key-value store (in the GCS), and the keys Ray's autoscaler publishes there.

``ray.experimental.internal_kv``'s ``_internal_kv_get``/``_put``/``_del`` are what Ray's own
libraries use to share small values across a cluster; Ray has no public key-value store. Its
autoscaler publishes under two keys there what it is (``__autoscaler_v2_enabled`` in the
``__autoscaler`` namespace; ``ray._raylet.GCS_AUTOSCALER_V2_ENABLED_KEY``) and, for v1, what it
reports (``__autoscaling_status``, ``ray._private.ray_constants.DEBUG_AUTOSCALING_STATUS``, what
``ray status`` reads). Every function here raises what Ray raises: callers decide what a failure means.
"""

from __future__ import annotations

import json

INTERNAL_KV = "ray.experimental.internal_kv"
# (key, namespace) of the autoscaler's own entries, with the names Ray gives them.
AUTOSCALER_V2_ENABLED = ("__autoscaler_v2_enabled", "__autoscaler")
AUTOSCALING_STATUS = ("__autoscaling_status", None)
RAY_KEY_NAMES = {
    "__autoscaler_v2_enabled": ("ray._raylet", "GCS_AUTOSCALER_V2_ENABLED_KEY"),
    "__autoscaler": ("ray._raylet", "GCS_AUTOSCALER_STATE_NAMESPACE"),
    "__autoscaling_status": ("ray._private.ray_constants", "DEBUG_AUTOSCALING_STATUS"),
}


def kv_get(key: str, namespace: str | None = None) -> bytes | None:
    from ray.experimental.internal_kv import _internal_kv_get

    return _internal_kv_get(key, namespace=namespace)


def kv_put(key: str, value: bytes, namespace: str | None = None) -> None:
    """Store ``value`` under ``key``, replacing what is there."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, value, overwrite=True, namespace=namespace)


def kv_delete(key: str, namespace: str | None = None) -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(key, namespace=namespace)


def autoscaler_v2_enabled() -> bool:
    """Whether the cluster's autoscaler is v2 (KubeRay, newer Ray), as the autoscaler itself stored."""
    key, namespace = AUTOSCALER_V2_ENABLED
    return kv_get(key, namespace=namespace) == b"1"


def autoscaling_status() -> dict | None:
    """Autoscaler v1's status (what ``ray status`` prints), None where none was published."""
    key, namespace = AUTOSCALING_STATUS
    raw = kv_get(key, namespace=namespace)
    return json.loads(raw) if raw else None
