"""All of a call's worker output on the driver before the call returns.

Ray forwards what a worker prints to the driver asynchronously (a log monitor tails the workers'
log files every 0.1 s, and its de-duplication holds repeated lines for seconds), so lines a worker
printed during a call could reach the driver after ``fit`` returned, mixed into what the user's
script prints next. So at the end of each call every worker flushes Python's and C's buffers and
writes a marker line to its stdout and stderr (:func:`end_of_output`); on the driver,
:class:`OutputSync` wraps Ray's own log printer, takes the markers out of what it prints, and lets
the launcher wait (bounded) until every rank's markers arrived: every line before them has been
printed by then, with Ray's usual ``(rank N pid=...)`` prefix.

Ray has no public API for this: the printer is the ``"ray_print_logs"`` handler of Ray's private
``global_worker_stdstream_dispatcher``, and the de-duplicators are private too; both are reached
through :mod:`ray_lightning._ray.logs`. If anything is missing (another Ray version, Ray Client, a
Tune trial process, ``log_to_driver=False``) no marker is asked for and nothing is waited for:
output then arrives as Ray delivers it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from ray_lightning._ray import logs as ray_logs

# Starts the marker line; "\x1b[8m" (concealed) in case a terminal ever shows one.
_MARKER = "\x1b[8mray_lightning-end-of-call "


def end_of_output(marker: str | None) -> None:
    """In a worker, at the end of a call: flush everything printed so far, then write ``marker`` on both streams."""
    if marker is None:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)  # C stdio buffers (gloo, NCCL and other native logs)
    line = f"{_MARKER}{marker}\n".encode()
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            os.write(fd, line)


class OutputSync:
    """The driver's side: Ray's log printer, wrapped to notice the markers; one per driver process."""

    def __init__(self) -> None:
        self._seen: dict[str, set[bool]] = {}  # marker -> the streams (is_err) it arrived on
        self._changed = threading.Condition()

    def new_marker(self) -> str | None:
        """A marker for one call, or None where the markers cannot be noticed (then none is written)."""
        installed = ray_logs.wrap_output_printer(lambda printer: _wrap(printer, self._handle))
        return f"{uuid.uuid4().hex}" if installed else None

    def wait(self, markers: Iterable[str], timeout_s: float) -> bool:
        """Wait until every marker arrived on stdout and stderr, at most ``timeout_s``; whether they all did."""
        wanted = set(markers)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                arrived = all(len(self._seen.get(m, ())) == 2 for m in wanted)
                left = deadline - time.monotonic()
                if arrived or left <= 0:
                    for marker in wanted:
                        self._seen.pop(marker, None)
                    return arrived
                self._changed.wait(left)

    def _handle(self, data: dict[str, Any], printer: Callable[[dict[str, Any]], None]) -> None:
        lines = data.get("lines") or []
        markers = [line.split(_MARKER, 1)[1].strip() for line in lines if _MARKER in line]
        if not markers:
            printer(data)
            return
        rest = [line for line in lines if _MARKER not in line]
        if rest:
            printer({**data, "lines": rest})
        ray_logs.flush_deduplicated_output()  # so that none of them comes after the call
        with self._changed:
            for marker in markers:
                self._seen.setdefault(marker, set()).add(bool(data.get("is_err")))
            self._changed.notify_all()


def _wrap(printer: Callable, handle: Callable) -> Callable:
    def print_logs(data: dict[str, Any]) -> None:
        handle(data, printer)

    return print_logs


output_sync = OutputSync()
