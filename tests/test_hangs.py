"""A stuck rank stops the call within its bound, naming the rank, its phase and every rank's stack.

Real Ray, real gloo and real Horovod; the ranks really block (``time.sleep``, a barrier only one
rank enters, an ``init_hook`` that never returns), and the test asserts what a user reads.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import pytorch_lightning as pl

from ray_lightning import HorovodRayStrategy, RayStrategy, RayWorkerError
from ray_lightning.channel.heartbeat import ProgressReport
from ray_lightning.errors import WorkerHangError
from ray_lightning.launch.watchdog import Watchdog
from tests.conftest import alive_worker_actors, wait_for
from tests.models import BoringModel

FOREVER_S = 3600
# The bounds the tests wait for: a healthy phase of these small fits (setup, a batch, a hook) takes well
# under a second, a few on a busy 2-core machine; warm workers start a call without imports.
PROGRESS_BOUND_S = 10
START_BOUND_S = 15


class SleepsInTrainingStep(BoringModel):
    """Rank 1 blocks inside ``training_step`` of batch 2, as a deadlocked data loader or a bug would."""

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 2:
            time.sleep(FOREVER_S)
        return super().training_step(batch, batch_idx)


class OneSidedBarrier(BoringModel):
    """Only rank 0 enters a barrier at the end of the first epoch; the other rank trains on."""

    def on_train_epoch_end(self):
        if self.global_rank == 0 and self.current_epoch == 0:
            self.trainer.strategy.barrier("only rank 0 comes here")


def block_rank_one_forever() -> None:
    """An init_hook that never returns on rank 1."""
    if os.environ.get("RANK") == "1":
        time.sleep(FOREVER_S)


def _strategy(kind: str, **kwargs):
    kwargs = {"keep_workers_alive_s": 0, **kwargs}
    if kind == "horovod":
        pytest.importorskip("horovod.torch", reason="Horovod is not installed: `python3 dev.py test` builds it")
        return HorovodRayStrategy(num_workers=2, **kwargs)
    return RayStrategy(num_workers=2, **kwargs)


def _fit_until_it_hangs(model: pl.LightningModule, strategy) -> WorkerHangError:
    trainer = pl.Trainer(
        max_epochs=2,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    with pytest.raises(RayWorkerError) as caught:
        trainer.fit(model)
    assert isinstance(caught.value, WorkerHangError), str(caught.value)
    # "All workers have been stopped": no worker process is left holding resources.
    wait_for(lambda: not alive_worker_actors(), 30, "the stuck call's workers to be stopped")
    return caught.value


def _stack_section(message: str, rank: int) -> str:
    start = message.index(f"--- Python stack of rank {rank} ")
    end = message.find("--- Python stack of rank", start + 1)
    return message[start : end if end >= 0 else None]


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("kind", ["ddp", "horovod"])
def test_a_rank_blocked_in_training_step_is_named_with_its_stack(kind):
    error = _fit_until_it_hangs(SleepsInTrainingStep(), _strategy(kind, progress_timeout_s=PROGRESS_BOUND_S))
    message = str(error)
    assert error.ranks == [1] and error.rank == 1, message
    assert "training" in error.phase and "training_step" in error.phase, message
    assert f"progress_timeout_s={PROGRESS_BOUND_S}" in message
    assert "rank 1 (stuck): training (epoch 0, batch 2: training_step)" in message, message
    # The stuck rank's own stack shows where it blocks, in the user's code.
    assert "SleepsInTrainingStep.training_step" in _stack_section(message, 1), message
    assert "(no stack" not in _stack_section(message, 0), message


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("kind", ["ddp", "horovod"])
def test_a_barrier_entered_by_one_rank_only_names_that_rank(kind):
    error = _fit_until_it_hangs(OneSidedBarrier(), _strategy(kind, progress_timeout_s=PROGRESS_BOUND_S))
    message = str(error)
    assert error.ranks == [0], message
    if kind == "ddp":
        assert "epoch 0 end" in error.phase, message
        assert "OneSidedBarrier.on_train_epoch_end" in _stack_section(message, 0), message
    else:
        # Horovod's barrier is hvd.join, which lets rank 1 train on alone and finish; then rank 0's
        # join returns and it waits forever in the next epoch's gradient allreduce. Rank 1 is past training
        # (on a loaded machine it may still be collecting its results when rank 0's bound passes).
        assert re.search(r"rank 1: (finished its part of the call|collecting the results)", message), message
        assert "synchronize" in _stack_section(message, 0), message


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("kind", ["ddp", "horovod"])
def test_a_hanging_init_hook_is_bounded_by_worker_start_timeout_s(kind):
    # Started workers (kept from a first fit) leave the bound to the init_hook alone, however busy the machine.
    warm = _strategy(kind, keep_workers_alive_s=60)
    pl.Trainer(max_epochs=1, limit_train_batches=1, strategy=warm, logger=False, enable_progress_bar=False).fit(
        BoringModel()
    )
    strategy = _strategy(
        kind, init_hook=block_rank_one_forever, worker_start_timeout_s=START_BOUND_S, progress_timeout_s=None
    )
    error = _fit_until_it_hangs(BoringModel(), strategy)
    message = str(error)
    assert error.ranks == [1] and error.phase == "init_hook", message
    assert f"worker_start_timeout_s={START_BOUND_S}" in message
    assert "block_rank_one_forever" in _stack_section(message, 1), message


# -- the watchdog's decisions, on a clock the test moves --------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watchdog(clock: _Clock, progress_timeout_s: float | None = 60.0) -> Watchdog:
    return Watchdog([0, 1], [], progress_timeout_s=progress_timeout_s, start_timeout_s=30.0, clock=clock)


def test_startup_phases_have_the_start_bound_and_training_the_progress_bound():
    clock = _Clock()
    watchdog = _watchdog(clock)
    assert watchdog.seconds_left() == 30.0  # both ranks are starting the call
    watchdog.record(ProgressReport(0, 5, "training", "epoch 0, batch 0: training_step", startup=False))
    watchdog.record(ProgressReport(1, 5, "training", "epoch 0, batch 0: training_step", startup=False))
    clock.now += 59
    assert watchdog.overdue() == [] and watchdog.seconds_left() == pytest.approx(1.0)
    watchdog.record(ProgressReport(0, 6, "training", "epoch 0: backward", startup=False))
    clock.now += 1
    assert watchdog.overdue() == [1]  # rank 0 moved a second ago; rank 1 has not for 60 s


def test_the_furthest_behind_are_stuck_the_others_wait():
    clock = _Clock()
    watchdog = _watchdog(clock)
    watchdog.record(ProgressReport(0, 9, "training", "epoch 0: backward", startup=False))
    watchdog.record(ProgressReport(1, 8, "training", "epoch 0, batch 2: training_step", startup=False))
    clock.now += 61
    error = watchdog.hang_error(watchdog.overdue(), ["stack 0", "stack 1"])
    assert error.ranks == [1] and error.phase == "training (epoch 0, batch 2: training_step)"
    assert "rank 0: training (epoch 0: backward), no progress for 61 s" in str(error)
    assert "stack 1" in str(error) and "progress_timeout_s=60" in str(error)


def test_the_rank_behind_is_stuck_even_when_a_waiting_rank_passes_its_bound_first():
    # Rank 1 stopped in init_hook after rank 0 had reached the rendezvous: rank 0's bound passes first
    # (seen in a loaded run), but rank 0 only waits for rank 1.
    clock = _Clock()
    watchdog = _watchdog(clock)
    watchdog.record(ProgressReport(0, 4, "rendezvous", "hvd.init", startup=True))
    clock.now += 5
    watchdog.record(ProgressReport(1, 3, "init_hook", startup=True))
    clock.now += 25
    assert watchdog.overdue() == [0]
    error = watchdog.hang_error([0], [])
    assert error.ranks == [1] and error.phase == "init_hook", str(error)
    assert "worker_start_timeout_s=30" in str(error) and "rank 0: rendezvous (hvd.init)" in str(error)


def test_no_progress_bound_leaves_only_the_startup_bound():
    clock = _Clock()
    watchdog = _watchdog(clock, progress_timeout_s=None)
    for rank in (0, 1):
        watchdog.record(ProgressReport(rank, 4, "training", startup=False))
    clock.now += 10_000
    assert watchdog.overdue() == [] and watchdog.seconds_left() is None


def test_a_rank_whose_call_returned_is_no_longer_watched():
    clock = _Clock()
    watchdog = _watchdog(clock)
    watchdog.record(ProgressReport(0, 3, "setup", startup=False))
    watchdog.finished(1)
    clock.now += 61
    assert watchdog.overdue() == [0]
    assert "rank 1: finished its part of the call" in str(watchdog.hang_error([0], []))


def test_reports_out_of_order_or_unchanged_do_not_reset_the_clock():
    clock = _Clock()
    watchdog = _watchdog(clock)
    watchdog.record(ProgressReport(0, 7, "training", startup=False))
    clock.now += 40
    watchdog.record(ProgressReport(0, 7, "training", startup=False))  # the same count again
    watchdog.record(ProgressReport(0, 3, "setup", startup=False))  # an older report
    clock.now += 21
    assert 0 in watchdog.overdue()
