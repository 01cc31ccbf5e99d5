"""Each rank's step times: the clock in the rank, the stragglers named on the driver, the start-up breakdown."""

from __future__ import annotations

import csv
import logging
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from ray_lightning.channel import timings
from ray_lightning.channel.timings import (
    COMPUTE,
    DATA,
    IDLE,
    OPTIMIZER,
    PHASES,
    RankTimes,
    StepClock,
    breakdown_text,
    startup_breakdown,
    table,
)
from ray_lightning.launch.stragglers import INTERVALS, StepTimes


class FakeTime:
    """``time.perf_counter`` that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


@pytest.fixture
def now(monkeypatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(timings, "time", fake)
    return fake


def _step(clock: StepClock, now: FakeTime, data: float, forward: float, comm: float, wait: float, opt: float):
    """One training step as the loop's hooks see it: the batch fetched, forward and backward (of which DDP's
    reducer timed ``wait`` after the rank's own gradients), the optimizer."""
    now.now += data
    clock.enter(COMPUTE)
    now.now += forward + comm + wait
    clock.wait_probe = lambda: wait
    clock.backward_done()
    clock.enter(OPTIMIZER)
    now.now += opt
    clock.step_done()


def test_the_clock_splits_each_step_into_its_phases(now):
    clock = StepClock()
    clock.enter(DATA)
    for _ in range(4):
        _step(clock, now, data=0.002, forward=0.005, comm=0.0, wait=0.003, opt=0.001)
    ms = RankTimes.of(clock.snapshot()).per_step_ms()
    assert clock.steps == 4
    assert ms == pytest.approx({"data": 2, "compute": 5, "collective": 3, "optimizer": 1, "checkpoint": 0})


def test_a_checkpoint_is_its_own_phase_and_validation_is_none_of_them(now):
    clock = StepClock()
    clock.enter(DATA)
    _step(clock, now, data=0.001, forward=0.004, comm=0.0, wait=0.0, opt=0.001)
    clock.checkpoint_started()  # saved after the step, before the next batch: not data time
    now.now += 0.5
    clock.checkpoint_done()
    now.now += 0.001
    clock.enter(IDLE)  # validation starts
    now.now += 3.0
    clock.enter(DATA)
    now.now += 0.001
    clock.enter(COMPUTE)
    seconds = RankTimes.of(clock.snapshot()).seconds
    assert seconds["checkpoint"] == pytest.approx(0.5)
    assert seconds["data"] == pytest.approx(0.003), "validation's 3 s are no step's"
    # A save whose end is not seen (a sharded strategy's) ends at the next phase.
    clock.checkpoint_started()
    now.now += 0.2
    clock.enter(OPTIMIZER)
    assert RankTimes.of(clock.snapshot()).seconds["checkpoint"] == pytest.approx(0.7)


def test_the_wait_is_read_on_sampled_steps_only_and_never_exceeds_the_backward(now):
    clock = StepClock()
    reads = []
    clock.wait_probe = lambda: reads.append(clock.steps) or 0.004
    clock.enter(DATA)
    for _ in range(120):
        _step_with(clock, now, backward=0.010)
    assert reads == [*range(10), 50, 100], "the first ten backwards, then one in PROBE_EVERY steps"
    seconds = RankTimes.of(clock.snapshot()).seconds
    assert seconds["collective"] == pytest.approx(120 * 0.004)
    assert seconds["compute"] == pytest.approx(120 * 0.006)
    clock.wait_probe = lambda: 0.050  # a sample longer than this backward (a slow one): capped at the backward
    clock.steps = 100
    _step_with(clock, now, backward=0.010)
    assert RankTimes.of(clock.snapshot()).seconds["compute"] == pytest.approx(120 * 0.006)


def _step_with(clock: StepClock, now: FakeTime, backward: float) -> None:
    clock.enter(COMPUTE)
    now.now += backward
    clock.backward_done()
    clock.step_done()
    now.now += 0.001
    clock.enter(DATA)


def test_without_a_probe_the_wait_is_part_of_compute(now):
    clock = StepClock()
    clock.enter(COMPUTE)
    now.now += 0.010
    clock.backward_done()  # Horovod, sharded strategies: nothing reports the wait
    assert RankTimes.of(clock.snapshot()).seconds["compute"] == pytest.approx(0.010)
    assert RankTimes.of(clock.snapshot()).seconds["collective"] == 0


def _snapshot(steps: int, **ms: float) -> tuple:
    return (steps, *(ms.get(p, 0.0) * steps / 1000 for p in PHASES))


def _feed(times: StepTimes, intervals: range, slow: dict, fast: dict, ranks=(0, 1, 2), slow_rank=1) -> None:
    """Every rank's report of each interval (cumulative: 10 steps an interval), rank ``slow_rank`` ``slow``."""
    for k in intervals:
        for rank in ranks:
            times.record(rank, _snapshot(10 * k, **(slow if rank == slow_rank else fast)))


def test_a_rank_slow_at_loading_its_data_is_named_once_with_its_node_and_what_to_look_at():
    said: list[str] = []
    times = StepTimes([0, 1, 2], ["10.0.0.1", "10.0.0.2", "10.0.0.3"], said.append)
    fast = {"data": 1, "compute": 5, "collective": 30, "optimizer": 1}
    slow = {"data": 30, "compute": 5, "collective": 1, "optimizer": 1}
    _feed(times, range(1, INTERVALS), slow, fast)  # the first report is an interval's end too
    assert not said, "not before it was slow for INTERVALS intervals"
    _feed(times, range(INTERVALS, INTERVALS + 5), slow, fast)
    (message,) = said
    assert "rank 1 (node 10.0.0.2) holds the others back" in message
    assert "data 30.0 ms against 1.0" in message and "Most of the difference is data" in message
    assert "preprocessing and I/O on that node" in message
    assert times.named == {1}
    assert times.result()[1].per_step_ms()["data"] == pytest.approx(30)


def test_a_rank_slow_at_its_step_is_named_for_its_compute_and_noise_is_not():
    said: list[str] = []
    times = StepTimes([0, 1], ["a", "b"], said.append)
    _feed(times, range(1, 6), {"compute": 14, "data": 0.1}, {"compute": 5, "data": 0.1, "collective": 9}, ranks=(0, 1))
    (message,) = said
    assert "rank 1 (node b)" in message and "Most of the difference is compute" in message
    assert "noisy neighbour" in message
    # 0.6 ms against 0.4: a large ratio of nothing.
    quiet = StepTimes([0, 1], ["a", "b"], said.append)
    _feed(quiet, range(1, 7), {"compute": 0.6}, {"compute": 0.4}, ranks=(0, 1))
    assert len(said) == 1 and not quiet.named


def test_the_table_and_the_startup_breakdown_read_well():
    text = table({0: RankTimes.of(_snapshot(4, data=2, compute=5), "10.0.0.1"), 1: RankTimes.of(_snapshot(4))})
    assert "rank" in text and "10.0.0.1" in text and "7.00" in text
    driver = {"fit called (driver)": 10.0, "Ray ready (driver)": 12.5, "workers placed (driver)": 13.0}
    rank_zero = {"worker process started": 9.0, "worker imports done": 15.0, "first step done": 16.0}
    breakdown = startup_breakdown(driver, rank_zero)
    assert [name for name, *_ in breakdown] == [
        "fit called (driver)", "Ray ready (driver)", "workers placed (driver)", "worker imports done",
        "first step done",
    ], "a process started before the call (kept from the last one) is not this start-up's"  # fmt: skip
    assert breakdown[-1][1:] == (6.0, 1.0)
    assert "+  2.50 s" in breakdown_text(breakdown)


# -- On real workers ---------------------------------------------------------------------------------------------


class SlowBatches(torch.utils.data.Dataset):
    """Rows of 8 features; on rank ``slow_rank``, each row takes ``pause_s`` to load (``where == "data"``)."""

    def __init__(self, where: str, slow_rank: int, pause_s: float) -> None:
        self.where, self.slow_rank, self.pause_s = where, slow_rank, pause_s

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.where == "data" and torch.distributed.get_rank() == self.slow_rank:
            time.sleep(self.pause_s)
        return torch.full((8,), float(i % 7))


class SlowRankModel(pl.LightningModule):
    """A linear layer trained on :class:`SlowBatches`; rank ``slow_rank`` sleeps in its step (``where == "step"``)
    or in its data loading (``"data"``); logs whether the Trainer's model is DDP's wrapper."""

    def __init__(self, where: str = "", slow_rank: int = 1, pause_s: float = 0.0) -> None:
        super().__init__()
        self.where, self.slow_rank, self.pause_s = where, slow_rank, pause_s
        self.layer = torch.nn.Linear(8, 1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(SlowBatches(self.where, self.slow_rank, self.pause_s / 8), batch_size=8)

    def training_step(self, batch, batch_idx):
        if self.where == "step" and self.global_rank == self.slow_rank:
            time.sleep(self.pause_s)
        wrapped = isinstance(self.trainer.strategy.model, torch.nn.parallel.DistributedDataParallel)
        self.log("ddp_wrapped", float(wrapped), reduce_fx="max", on_step=False, on_epoch=True)
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("where, phase", [("data", "data"), ("step", "compute")])
def test_a_rank_made_slow_is_named_while_it_trains_and_its_times_reach_the_loggers(
    where, phase, tmp_path, caplog, ray_local
):
    from pytorch_lightning.loggers import CSVLogger

    from ray_lightning import RayStrategy

    # progress_timeout_s=10: a heartbeat (an interval of the step times) every second; 110 steps of >= 40 ms.
    strategy = RayStrategy(num_workers=2, progress_timeout_s=10)
    trainer = pl.Trainer(strategy=strategy, max_steps=110, logger=CSVLogger(tmp_path), log_every_n_steps=50,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="ray_lightning"):
        trainer.fit(SlowRankModel(where, slow_rank=1, pause_s=0.04))
    named = [r.getMessage() for r in caplog.records if "holds the others back" in r.getMessage()]
    assert len(named) == 1, named
    assert "rank 1 (node " in named[0] and f"Most of the difference is {phase}" in named[0]
    times = trainer.strategy.timings
    assert sorted(times) == [0, 1] and times[0].steps == times[1].steps == 110
    slow, fast = times[1].per_step_ms(), times[0].per_step_ms()
    assert slow[phase] > fast[phase] + 25, (slow, fast)
    assert fast["collective"] > slow["collective"] + 25, "the fast rank waits for the slow one in the all-reduce"
    assert trainer.callback_metrics["ddp_wrapped"] == 1.0
    # The same figures as curves, through the Trainer's own logger (rank 0 writes them, every 50 steps).
    rows = list(csv.DictReader(open(Path(trainer.logger.log_dir) / "metrics.csv")))
    logged = [r for r in rows if r.get(f"timings/rank1/{phase}_ms")]
    assert [int(r["step"]) for r in logged] == [50, 100]
    assert all(float(r[f"timings/rank1/{phase}_ms"]) > float(r[f"timings/rank0/{phase}_ms"]) + 25 for r in logged)


def test_one_worker_trains_without_ddps_wrapper_and_reports_its_startup(ray_local):
    from ray_lightning import RayStrategy

    model = SlowRankModel()
    before = model.layer.weight.detach().clone()
    trainer = pl.Trainer(strategy=RayStrategy(num_workers=1), max_steps=5, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(model)
    assert trainer.callback_metrics["ddp_wrapped"] == 0.0, "one worker: the module trains as it is"
    assert not torch.equal(before, model.layer.weight), "the trained weights came home"
    marks = [name for name, *_ in trainer.strategy.startup]
    assert marks[0] == "fit called (driver)" and marks[-1] == "first step done", marks
    assert {"call received", "first batch", "process group joined, setup hooks"} <= set(marks)
    assert trainer.strategy.timings[0].steps == 5
