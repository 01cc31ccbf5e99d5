"""Amounts and resources written for people: ``2``, ``0.5``, ``1.5 GiB``, ``{CPU: 4, GPU: 1}``."""

from __future__ import annotations

from collections.abc import Mapping


def fmt_amount(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


# Ray's resources counted in bytes.
_BYTES = ("memory", "object_store_memory")


def fmt_resource(name: str, value: float) -> str:
    """``value`` of resource ``name`` for people: bytes in KiB/MiB/GiB/..., other amounts as numbers."""
    if name not in _BYTES:
        return fmt_amount(value)
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    index = 0
    while abs(value) >= 1024 and index < len(units) - 1:
        value, index = value / 1024, index + 1
    return f"{value:.1f}".removesuffix(".0") + f" {units[index]}"


def describe_totals(resources: Mapping[str, float], memory: bool = False) -> str:
    """``{CPU: 4, GPU: 1, my_resource: 2}``: what a node, cluster or request holds.

    Node markers and placement-group resources are left out, and so is memory unless ``memory``
    (it is in bytes, and only worth showing when it is what a request lacks).
    """
    shown = {
        k: v
        for k, v in resources.items()
        if not k.startswith("node:") and "_group_" not in k and k != "object_store_memory" and (memory or k != "memory")
    }
    return "{" + ", ".join(f"{k}: {fmt_resource(k, v)}" for k, v in sorted(shown.items())) + "}"
