"""Checks of the keyword arguments the strategies share: unknown names, arguments a strategy decides, ``init_hook``."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable
from typing import Any


def check_keywords(owner: str, given: Iterable[str], accepted: Iterable[str], takes: str) -> None:
    """Refuse keyword arguments ``owner`` does not take, with the closest accepted name.

    ``takes`` says in words what ``owner`` accepts, for the error message.
    """
    accepted = sorted(set(accepted))
    unknown = sorted(set(given) - set(accepted))
    if not unknown:
        return
    lines = []
    for name in unknown:
        close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.6)
        lines.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(
        f"{owner} got unknown keyword argument(s) {', '.join(lines)}. {owner} takes {takes}: {', '.join(accepted)}."
    )


def refuse_decided(owner: str, kwargs: dict[str, Any], decided: dict[str, str]) -> dict[str, Any]:
    """The keyword arguments to pass on to Lightning, without those ``owner`` decides itself (name -> why).

    Those given as None are dropped (LightningCLI/jsonargparse passes every argument of Lightning's
    strategy with its default); any other value of them is refused, saying why.
    """
    kwargs = {k: v for k, v in kwargs.items() if not (k in decided and v is None)}
    given = sorted(set(decided) & set(kwargs))
    if given:
        reasons = "; ".join(f"{name} itself ({decided[name]})" for name in given)
        raise TypeError(f"{owner} sets {reasons}; do not pass {', '.join(given)}.")
    return kwargs


def check_init_hook(init_hook: Any) -> None:
    """``init_hook`` is called in every worker with no arguments: refuse what cannot be."""
    if init_hook is None:
        return
    if not callable(init_hook):
        raise TypeError(f"init_hook must be a function taking no arguments, got {init_hook!r}.")
    try:
        signature = inspect.signature(init_hook)
    except (TypeError, ValueError):
        return  # a builtin without a signature: it will tell for itself
    try:
        signature.bind()
    except TypeError as error:
        raise TypeError(
            f"init_hook is called with no arguments in every worker, but {init_hook!r} cannot be ({error}). "
            "Give it defaults, or wrap it: init_hook=lambda: setup(value)."
        ) from None
