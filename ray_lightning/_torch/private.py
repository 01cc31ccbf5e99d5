"""The record of one private name of a library ray_lightning relies on.

Shared by the three fences (:mod:`ray_lightning._torch`, :mod:`ray_lightning._ray`,
:mod:`ray_lightning._lightning`): each lists its names as :class:`PrivateName`\\ s in its
``PRIVATE_NAMES``, and a test of its own checks each still exists. It is kept here because
``_torch`` is the lowest of the three layers (``tests/test_layers.py``): the other two may import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PrivateName:
    """One private name we rely on: ``name`` on what ``owner`` finds (a module, class or object)."""

    where: str
    name: str  # may be dotted: a path of attributes
    owner: Callable[[], Any]
    needs: str | None = None  # the optional package the owner needs (a logger's), if any

    def missing(self) -> str | None:
        """None if the name is still there; else what is missing."""
        try:
            obj = self.owner()
        except Exception as error:  # noqa: BLE001 - whatever broke is what moved
            return f"{self.where}: cannot get it ({type(error).__name__}: {error})"
        for part in self.name.split("."):
            if not hasattr(obj, part):
                return f"{self.where} has no {self.name} (no {part!r} on {type(obj).__name__})"
            obj = getattr(obj, part)
        return None
