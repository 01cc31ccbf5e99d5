"""What comes to the driver after a call: rank 0's results and files onto the Trainer, the trained weights a chunk
at a time (:func:`weight_chunks`), the step times, and after a failure what rank 0 had written on its node.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ray_lightning import namespaces
from ray_lightning.channel.timings import startup_breakdown, table
from ray_lightning.home import files, landing
from ray_lightning.home.predictions import merge_predictions
from ray_lightning.home.results import WorkerOutput, apply_to_driver
from ray_lightning.launch.call_record import Attempt, DriverCall
from ray_lightning.launch.protocol import LaunchedStrategy

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from ray_lightning.launch.worker_group import WorkerGroup

log = logging.getLogger(__name__)

# How long the driver waits, after a failure, for rank 0 to come out of the call (a peer's loss breaks its
# collective about when the driver learns of it) to collect its files itself before a new process does.
RANK_ZERO_WAIT_S = 5.0


class BringsHome:
    """The part of :class:`~ray_lightning.launch.launcher.RayLauncher` that copies a call's results to the driver."""

    _strategy: LaunchedStrategy
    transferred_files: list[str]

    def _publish_times(self, attempt: Attempt, call: DriverCall) -> None:
        """The call's step times and start-up on the strategy (``timings``, ``startup``); the times' table, once."""
        strategy = self._strategy
        if attempt.watchdog is None or not hasattr(strategy, "timings"):
            return  # Fabric's strategies: no training loop to time
        timings = attempt.watchdog.times.result()
        # In place: a strategy rebuilt for the other Lightning namespace shares them with the caller's.
        strategy.timings.clear()
        strategy.timings.update(timings)
        strategy.startup[:] = startup_breakdown(call.marks, attempt.watchdog.startup_marks.get(0, {}))
        if any(t.steps for t in timings.values()):
            log.info("%s", table(timings))

    def _bring_home(self, attempt: Attempt, trainer: pl.Trainer | None, call: DriverCall) -> Any:
        outputs = attempt.outputs or []
        rank_zero = next(o for o in outputs if o is not None and o.global_rank == 0)
        if trainer is None:
            return self._function_home(outputs, rank_zero, call.scope)
        written = apply_to_driver(trainer, rank_zero, call.scope, weight_chunks(attempt.group.actors, outputs))
        for output in outputs:
            if output is not None and output is not rank_zero and output.files:
                # Other ranks' parts of sharded checkpoints, beside rank 0's.
                written += landing.write(output.files, call.scope.with_checkpoints(rank_zero.callback_states))
        synced = call.recovery.synced
        if rank_zero.staged:
            # What rank 0 mirrored here during the call and no longer had at its end, it removed.
            landing.remove(synced - set(rank_zero.files), call.scope)
        transferred = (set(self.transferred_files) | synced | set(written)) - {""}
        self.transferred_files = sorted(p for p in transferred if os.path.isfile(p))
        if self.transferred_files:
            log.info("ray_lightning: copied %s from rank 0's node to this machine", ", ".join(self.transferred_files))
        if trainer.state.fn == namespaces.PREDICTING:
            if not rank_zero.return_predictions:
                return None
            per_rank = [o.predictions or [] for o in outputs if o is not None]
            return merge_predictions(per_rank, rank_zero.num_predict_dataloaders)
        return rank_zero.results

    def _function_home(self, outputs: list[WorkerOutput | None], rank_zero: WorkerOutput, scope: Any) -> Any:
        """A function without a Trainer (Fabric's): the files ranks off this machine wrote, at the paths they
        gave (``fabric.save``, the loggers' directories: the only writes that stage), and rank 0's return value."""
        sent = {path: data for o in outputs if o is not None for path, data in o.files.items()}
        self.transferred_files = landing.write(sent, scope)
        if self.transferred_files:
            copied = ", ".join(self.transferred_files)
            log.info("ray_lightning: copied %s from the workers' nodes to this machine", copied)
        return rank_zero.results

    def _fetch_staged_files(self, area: files.StagingArea, call: DriverCall, group: WorkerGroup) -> bool:
        """After a failure: copy what rank 0 had written on its node (checkpoints, logs) to the driver; whether
        that could be done (not with its node gone). Rank 0's process collects them if it comes out of the failed
        call alive; else a new process on its node does."""
        try:
            timeout_s = self._strategy.workers.timeouts.start_s
            rank_zero = group.came_out(0, RANK_ZERO_WAIT_S)
            written = files.fetch_after_failure(area, timeout_s, call.scope, call.files_home, rank_zero)
        except Exception as error:  # noqa: BLE001 - the node may be gone; the failure itself is what matters
            log.warning("ray_lightning: could not fetch the files rank 0 wrote before the failure: %s", error)
            return False
        call.recovery.mirror(written)
        self.transferred_files = sorted(set(self.transferred_files) | set(written))
        if written:
            log.warning("ray_lightning: copied what rank 0 wrote before the failure: %s", ", ".join(written))
        return True


def weight_chunks(actors: list[Any], outputs: list[WorkerOutput | None], in_flight: int = 2) -> Iterator[Any]:
    """References to every chunk of trained weights the workers hold, asked for a few at a time.

    ``outputs`` are in actor order. While the driver copies one chunk into its module, the next is on
    its way; one that was read goes from the object store when its reference does.
    """
    counts = [(actor, out.weights if out is not None and out.weights else 0) for actor, out in zip(actors, outputs)]
    wanted = [(actor, index) for actor, count in counts for index in range(count)]
    pending: deque[Any] = deque()
    for actor, index in wanted:
        pending.append(actor.weights_chunk.remote(index))
        if len(pending) >= in_flight:
            yield pending.popleft()
    while pending:
        yield pending.popleft()
