"""Rank 0's progress bar, drawn by the driver; its other console output, forwarded by Ray.

Ray forwards a worker's output to the driver line by line, prefixed with the worker's rank.
Lightning's tqdm bars redraw themselves in place with ``\\r`` and cursor moves, so an epoch of
redraws would arrive as one endless line, or as a line per redraw. On rank 0,
:class:`ProgressLines` stands in for ``sys.stdout``: other output passes through unchanged, while
progress-bar states are picked out, at most one per ``interval_s`` plus each bar's finished (100%)
state. With a driver channel they go to the driver, which redraws one bar in place
(:func:`show_progress`); without one they become whole lines in the forwarded output.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import sys
import time
from collections.abc import Iterator
from typing import TextIO

from ray_lightning.channel.driver_channel import send_to_driver

# tqdm moves the cursor up/down to draw nested bars (validation inside an epoch).
_CURSOR_MOVES = re.compile(r"\x1b\[[0-9]*[AB]")
# A tqdm bar: "...|██▌   | 3/11 [" or "|          | 0/? [".
_BAR = re.compile(r"\|[^|]*\| *\d+/(\d+|\?) \[")


class ProgressLines(io.TextIOBase):
    """A text stream that writes complete lines to ``target`` and throttles in-place redraws."""

    def __init__(self, target: TextIO, interval_s: float | None = None, to_driver: bool = False) -> None:
        self._target = target
        self._to_driver = to_driver
        # The driver redraws in place, so it can take more frequent states than a log can.
        self._interval_s = interval_s if interval_s is not None else (0.25 if to_driver else 1.0)
        self._pending = ""  # the newest redraw of the current line, not yet written
        self._last_bar = -math.inf
        self._held: str | None = None  # the newest finished (100%) state of the last bar
        self._held_key: str | None = None

    def write(self, text: str) -> int:
        text = _CURSOR_MOVES.sub("", text)
        *complete, rest = text.split("\n")
        for part in complete:
            line = self._newest(self._pending + part)
            self._pending = ""
            self._offer(line, final=False)
        self._pending = self._newest(self._pending + rest)
        if "\r" in rest and self._offer(self._pending, final=False):
            self._pending = ""
        return len(text)

    def _offer(self, line: str, final: bool) -> bool:
        """Write ``line``, unless it is a bar state that comes too soon after the last one.

        A finished (100%) state is held back until another line arrives, so that only its last
        redraw (with the final metrics) is written.
        """
        if not line.strip():
            return False
        bar = _BAR.search(line)
        if bar is None:
            self._release_held()
            self._emit(line)
            return True
        key = line[: bar.end()]
        if "100%|" in line:
            if self._held_key != key:
                self._release_held()
            self._held, self._held_key = line, key
            return True
        self._release_held()
        now = time.monotonic()
        if final or now - self._last_bar >= self._interval_s:
            self._last_bar = now
            self._emit_bar(line, done=final)
            return True
        return False

    def _release_held(self) -> None:
        if self._held is not None:
            self._emit_bar(self._held, done=True)
        self._held = self._held_key = None

    def _emit_bar(self, line: str, done: bool) -> None:
        if self._to_driver:
            send_to_driver(show_progress, line.rstrip(), done)
        else:
            self._emit(line)

    @staticmethod
    def _newest(line: str) -> str:
        # tqdm ends a redraw with "\r" before the next one; keep the last non-empty redraw.
        redraws = [r for r in line.split("\r") if r.strip()]
        return redraws[-1] if redraws else ""

    def _emit(self, line: str) -> None:
        self._target.write(line.rstrip() + "\n")
        self._target.flush()

    def flush(self) -> None:
        self._target.flush()

    def close_line(self) -> None:
        """Write what is still pending (the final state of a bar)."""
        self._offer(self._pending, final=True)
        self._pending = ""
        self._release_held()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._target.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._target, "encoding", "utf-8")


@contextlib.contextmanager
def readable_output(enabled: bool, progress_to_driver: bool) -> Iterator[None]:
    """On rank 0 (``enabled``), turn the progress bar's in-place redraws into lines Ray can forward.

    With ``progress_to_driver`` the bar's states go to the driver, which draws the one bar.
    """
    if not enabled:
        yield
        return
    original = sys.stdout
    stream = ProgressLines(original, to_driver=progress_to_driver)
    sys.stdout = stream
    try:
        yield
    finally:
        stream.close_line()
        sys.stdout = original


# -- on the driver -----------------------------------------------------------------------------------

_drawn = 0  # length of the bar state drawn in place on the driver's current line, 0 if none
_last_line = -math.inf  # when a state was last written as a line of its own
_LINE_INTERVAL_S = 1.0  # where states become lines (logs, pipes), at most one per second


def show_progress(line: str, done: bool) -> None:
    """Draw a state of rank 0's progress bar on the driver: in place where the console can redraw.

    A finished bar (``done``) stays on its line; the next one starts below it.
    """
    global _drawn, _last_line
    out = sys.stdout
    if not _redraws_in_place(out):
        now = time.monotonic()
        if not done and now - _last_line < _LINE_INTERVAL_S:
            return
        _last_line = now
        out.write(line + "\n")
    else:
        out.write("\r" + line.ljust(_drawn) + ("\n" if done else ""))
        _drawn = 0 if done else len(line)
    out.flush()


def _redraws_in_place(stream: TextIO) -> bool:
    # Terminals and Jupyter's output areas honour "\r"; log files and pipes would keep every state.
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) or type(stream).__module__.startswith("ipykernel")
