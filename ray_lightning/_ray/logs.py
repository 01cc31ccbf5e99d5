"""Ray's printer of the output its workers forward to the driver, and its de-duplicators.

Ray prints what a worker writes through the ``"ray_print_logs"`` handler of
``ray._private.ray_logging.global_worker_stdstream_dispatcher`` (a list of named handlers under a
lock), after ``ray._private.worker``'s ``stdout_deduplicator``/``stderr_deduplicator`` held back
repeated lines; ``ray.shutdown`` flushes them with ``print_worker_logs``. None of it is public:
:func:`wrap_output_printer` and :func:`flush_deduplicated_output` do what
:mod:`ray_lightning.channel.worker_output` needs, and do nothing where a name is missing (another
Ray version, Ray Client, a process that prints no forwarded output).

The ``(name pid=...)`` in front of an actor's forwarded lines is what Ray's log monitor last read on a
``ray_constants.LOG_PREFIX_ACTOR_NAME`` line of the worker's log files (written once, at the actor's start):
:func:`name_this_actors_output` writes another, for a process whose rank changed.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

DISPATCHER = "ray._private.ray_logging"  # global_worker_stdstream_dispatcher: _lock, handlers
WORKER = "ray._private.worker"  # the de-duplicators and print_worker_logs
CONSTANTS = "ray._private.ray_constants"  # LOG_PREFIX_ACTOR_NAME: the log files' line that names the actor
PRINTER = "ray_print_logs"  # the name of the dispatcher's handler that prints forwarded output
_WRAPPED = "_ray_lightning"  # marks a printer wrapped by wrap_output_printer


def _dispatcher() -> Any:
    """Ray's private dispatcher of forwarded worker output, or None where this process prints none."""
    import ray

    if ray.util.client.ray.is_connected():
        return None
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher
    except ImportError:
        return None
    return global_worker_stdstream_dispatcher


def wrap_output_printer(wrap: Callable[[Callable[[dict[str, Any]], None]], Callable[[dict[str, Any]], None]]) -> bool:
    """Replace Ray's printer of forwarded worker output by ``wrap(printer)``, once per Ray session.

    Whether a wrapped printer is in place now (False where Ray has none: nothing is wrapped).
    """
    dispatcher = _dispatcher()
    lock, handlers = getattr(dispatcher, "_lock", None), getattr(dispatcher, "handlers", None)
    if lock is None or not isinstance(handlers, list):
        return False
    with lock:
        for i, (name, printer) in enumerate(dispatcher.handlers):
            if name != PRINTER:
                continue
            if getattr(printer, _WRAPPED, False):
                return True
            wrapped = wrap(printer)
            setattr(wrapped, _WRAPPED, True)
            dispatcher.handlers = [*dispatcher.handlers[:i], (name, wrapped), *dispatcher.handlers[i + 1 :]]
            return True
    return False


def flush_deduplicated_output() -> None:
    """Print the lines Ray's de-duplication holds back (as ``ray.shutdown`` does)."""
    try:
        from ray._private import worker
    except ImportError:
        return
    with contextlib.suppress(Exception):
        ignore_prefix = worker._should_ignore_worker_log_prefix(worker.global_worker)
        for deduplicator, sink in ((worker.stdout_deduplicator, sys.stdout), (worker.stderr_deduplicator, sys.stderr)):
            for batch in deduplicator.flush():
                worker.print_worker_logs(batch, sink, ignore_prefix)


def name_this_actors_output(name: str) -> None:
    """From here on, the driver prints this actor's lines as ``(name pid=...)`` (nothing where Ray has no marker)."""
    try:
        from ray._private.ray_constants import LOG_PREFIX_ACTOR_NAME
    except ImportError:
        return
    # Ray's log monitor reads the .out and the .err file apart: each gets the marker, which it does not forward.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            print(f"{LOG_PREFIX_ACTOR_NAME}{name}", file=stream, flush=True)
