"""Restarts inside one fit (``max_failures``), on the shared local Ray: real killed workers, real SIGTERM.

Multi-node failures (a node removed, a node drained for preemption) are in tests/test_restarts_multinode.py.
"""

from __future__ import annotations

import csv
import functools
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger

from ray_lightning import RayAccelerator, RayStrategy, RayWorkerError
from ray_lightning.errors import WorkerDiedError
from tests.conftest import alive_worker_actors, wait_for
from tests.models import BoringModel

pytestmark = pytest.mark.usefixtures("ray_local")


class FailsOnce(BoringModel):
    """Rank ``rank`` fails at ``batch`` of ``epoch`` the first time only (``marker`` records that it did).

    ``how``: ``kill`` (SIGKILL: the process dies), ``sigterm`` (SIGTERM: it is asked to go),
    ``raise`` (an exception in the user's code). ``step_s`` slows each step down. ``checkpoint_step``: the failing
    rank first waits (bounded) until the recovery checkpoint of that step is complete (they are written beside
    training: the tests check where a restart resumes, not a race with the upload), and records its files.
    """

    def __init__(
        self,
        marker: str,
        how: str = "kill",
        epoch: int = 1,
        batch: int = 2,
        rank: int = 1,
        step_s=0.0,
        dropout: float = 0.0,
        checkpoint_step: int | None = None,
        zero: bool = False,
    ):
        super().__init__()
        self.zero = zero  # torch's ZeroRedundancyOptimizer (SGD with momentum): each rank holds a shard of the state
        self.marker, self.how, self.fail_epoch, self.fail_batch, self.fail_rank = marker, how, epoch, batch, rank
        self.step_s = step_s
        self.checkpoint_step = checkpoint_step
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, x):
        return self.layer(self.dropout(x))

    def configure_optimizers(self):
        if not self.zero:
            return super().configure_optimizers()
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(self.parameters(), torch.optim.SGD, lr=self.hparams.lr, momentum=0.9)

    def on_fit_start(self):
        # Which process ran each rank, attempt after attempt, and when that process started.
        with open(self.marker + ".pids", "a") as f:
            f.write(f"{self.global_rank} {os.getpid()} {psutil.Process().create_time()} {torch.get_num_threads()}\n")

    def training_step(self, batch, batch_idx):
        if self.step_s:
            time.sleep(self.step_s)  # a step that takes time, as a real one does
        first_time = not os.path.exists(self.marker)
        if self.global_rank == self.fail_rank and (self.current_epoch, batch_idx) == (self.fail_epoch, self.fail_batch):
            if first_time or self.how == "always":
                if self.checkpoint_step is not None:
                    self._wait_for_the_checkpoint(self.checkpoint_step)
                with open(self.marker, "w") as f:
                    f.write(str(self.trainer.global_step))
                if self.how in ("kill", "always"):
                    os.kill(os.getpid(), signal.SIGKILL)
                elif self.how == "sigterm":
                    os.kill(os.getpid(), signal.SIGTERM)
                else:
                    raise ValueError("a bug in training_step")
        return super().training_step(batch, batch_idx)

    def _wait_for_the_checkpoint(self, step: int) -> None:
        from ray_lightning import runtime
        from ray_lightning.home import storage

        run = runtime.current_context().recovery.storage_run

        def complete() -> bool:
            entry = storage.newest_complete(run)
            return entry is not None and entry.header["global_step"] >= step

        wait_for(complete, 60, f"the recovery checkpoint of step {step}")
        fs, folder = storage.filesystem(storage.newest_complete(run).folder)
        with open(self.marker + ".checkpoint", "w") as f:
            f.write("\n".join(sorted(p.rsplit("/", 1)[1] for p in fs.ls(folder, detail=False))))


def _trainer(tmp_path, strategy, **kwargs) -> pl.Trainer:
    defaults = dict(
        max_epochs=3,
        strategy=strategy,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=CSVLogger(tmp_path / "logs"),
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)],
        log_every_n_steps=1,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


def _reference_weights(tmp_path, strategy_factory=RayStrategy, accumulate_grad_batches=1, **kwargs) -> torch.Tensor:
    """The weights of the same fit without a failure (the marker exists: nothing fails)."""
    directory = tmp_path / "reference"
    directory.mkdir()
    (directory / "marker").write_text("")
    pl.seed_everything(0)
    model = FailsOnce(str(directory / "marker"), **kwargs)
    trainer = _trainer(directory, strategy_factory(num_workers=2), accumulate_grad_batches=accumulate_grad_batches)
    trainer.fit(model)
    return model.layer.weight.detach().clone()


def _csv_rows(trainer) -> list[dict]:
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv"), newline="") as f:
        return list(csv.DictReader(f))


def test_a_killed_worker_restarts_and_the_fit_ends_as_without_the_failure(tmp_path, capfd):
    pl.seed_everything(0)
    marker = tmp_path / "killed"
    # Dropout draws random masks every step: the same weights need the random state carried over.
    model = FailsOnce(str(marker), dropout=0.3, checkpoint_step=4)
    two_cpus = functools.partial(RayStrategy, num_cpus_per_worker=2)  # torch's threads: 2 in every rank
    trainer = _trainer(tmp_path, two_cpus(num_workers=2, max_failures=1))
    trainer.fit(model)

    assert marker.exists(), "the worker was never killed"
    (restart,) = trainer.strategy.restarts
    assert (restart.rank, restart.reason, restart.number) == (1, "worker died", 1)
    # Went on from rank 0's memory: killed in epoch 1's third batch, after step 6 (4 steps per epoch: 64 samples,
    # batch 8, 2 workers), not from epoch 0's checkpoint (step 4); only the step in flight was lost.
    assert (restart.epoch, restart.global_step, restart.source, restart.steps_lost) == (1, 6, "memory", 0)
    assert "rank 1" in restart.cause and "died" in restart.cause
    assert restart.spares == 1
    assert (trainer.current_epoch, trainer.global_step) == (3, 12)
    assert torch.equal(model.layer.weight, _reference_weights(tmp_path, two_cpus, dropout=0.3))
    # Every epoch's checkpoint is there, and the log has each step once, in order.
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "epoch=0-step=4.ckpt",
        "epoch=1-step=8.ckpt",
        "epoch=2-step=12.ckpt",
    ]
    steps = [int(r["step"]) for r in _csv_rows(trainer) if r["train_loss"]]
    assert steps == list(range(12))
    FailsOnce.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)
    # The recovery checkpoints were on this machine (no storage_path) and are removed with the fit's end.
    from ray_lightning.home import driver_disk

    assert os.listdir(driver_disk.server_folder()) == []
    # The restart kept rank 0's process (it came out of the broken collective), and rank 1's new process is the
    # spare, started before the kill: the restart waited for no process to start and import.
    lines = [line.split() for line in (tmp_path / "killed.pids").read_text().splitlines()]
    first, second = sorted(lines[:2]), sorted(lines[2:])
    assert first[0] == second[0] and first[1][1] != second[1][1], lines
    assert float(second[1][2]) < marker.stat().st_mtime, "rank 1's new process started after the kill"
    assert [int(line[3]) for line in lines] == [2] * 4, "the spare (which reserved no CPU) trains with 2 threads too"
    # Its lines on the driver say which rank it is now, as the other ranks' do.
    out, err = capfd.readouterr()
    assert f"rank 1 pid={second[1][1]})" in out + err, (out + err)[-4000:]
    # The killed worker's actor is gone; the group (with a new spare) waits for the next call, or is stopped.
    killed_pid = int(first[1][1])
    wait_for(lambda: killed_pid not in {a.pid for a in alive_worker_actors()}, 30, "the killed worker's actor to go")


@pytest.mark.parametrize("zero", [False, True], ids=["sgd", "zero_redundancy_optimizer"])
def test_a_ddp_restart_from_a_checkpoint_reads_the_part_each_rank_wrote(tmp_path, monkeypatch, zero):
    # The driver restarts from the checkpoint, not from the survivor's memory (the workers' class is unchanged).
    monkeypatch.setattr(RayStrategy, "state_in_every_rank", False)
    pl.seed_everything(0)
    marker = tmp_path / "killed"
    trainer = _trainer(tmp_path, RayStrategy(num_workers=2, max_failures=1))
    model = FailsOnce(str(marker), checkpoint_step=4, zero=zero)
    trainer.fit(model)

    (restart,) = trainer.strategy.restarts
    assert (restart.epoch, restart.global_step, restart.source) == (1, 4, "checkpoint")
    # Rank 0 did not write the whole state: each rank wrote its part of the weights (and of SGD's momentum, which
    # ZeroRedundancyOptimizer gathers on rank 0 alone: rank 0 wrote it).
    assert (tmp_path / "killed.checkpoint").read_text().split() == [
        "COMPLETE.json",
        "part-0.pt",
        "part-1.pt",
        "skeleton.pt",
    ]
    assert (trainer.current_epoch, trainer.global_step) == (3, 12)
    assert torch.equal(model.layer.weight, _reference_weights(tmp_path, zero=zero))


def test_a_zero_redundancy_optimizer_fit_goes_on_from_the_checkpoint_not_from_a_survivors_shard(tmp_path):
    """ZeroRedundancyOptimizer shards the optimizer's state: no survivor holds the whole of it, so a restart after a
    kill reads the newest recovery checkpoint, and the fit ends as without the failure."""
    pl.seed_everything(0)
    trainer = _trainer(tmp_path, RayStrategy(num_workers=2, max_failures=1))
    model = FailsOnce(str(tmp_path / "killed"), checkpoint_step=4, zero=True)
    trainer.fit(model)
    (restart,) = trainer.strategy.restarts
    assert (restart.epoch, restart.global_step, restart.source) == (1, 4, "checkpoint"), restart
    assert (trainer.current_epoch, trainer.global_step) == (3, 12)
    assert torch.equal(model.layer.weight, _reference_weights(tmp_path, zero=True))


def test_a_killed_worker_mid_accumulation_goes_on_from_the_last_step_the_survivor_completed(tmp_path, monkeypatch):
    # Without spare processes (as a GPU fit, whose replacement is a new process): the restart waits for one.
    monkeypatch.setenv("RAY_LIGHTNING_SPARE_WORKERS", "0")
    pl.seed_everything(0)
    # 4 batches per epoch, a step every 2: rank 1 dies in epoch 1's 4th batch, whose step would be the 4th.
    model = FailsOnce(str(tmp_path / "killed"), epoch=1, batch=3, dropout=0.3)
    trainer = _trainer(tmp_path, RayStrategy(num_workers=2, max_failures=1), accumulate_grad_batches=2)
    trainer.fit(model)
    (restart,) = trainer.strategy.restarts
    # Epoch 1's 3rd batch had only accumulated its gradient (lost with the step): it trains again, from step 3.
    assert (restart.epoch, restart.global_step, restart.source, restart.spares) == (1, 3, "memory", 0)
    assert (trainer.current_epoch, trainer.global_step) == (3, 6)
    reference = _reference_weights(tmp_path, dropout=0.3, epoch=1, batch=3, accumulate_grad_batches=2)
    assert torch.equal(model.layer.weight, reference)


def test_an_exception_in_user_code_is_not_retried(tmp_path):
    trainer = _trainer(tmp_path, RayStrategy(num_workers=2, max_failures=2))
    started = time.monotonic()
    with pytest.raises(RayWorkerError, match="a bug in training_step") as info:
        trainer.fit(FailsOnce(str(tmp_path / "raised"), how="raise", epoch=0))
    assert info.value.rank == 1 and info.value.failures == []
    assert trainer.strategy.restarts == []
    assert time.monotonic() - started < 120


def test_failures_beyond_max_failures_raise_with_every_cause(tmp_path):
    trainer = _trainer(tmp_path, RayStrategy(num_workers=2, max_failures=1))
    with pytest.raises(WorkerDiedError) as info:
        trainer.fit(FailsOnce(str(tmp_path / "killed"), how="always", epoch=0))
    error = info.value
    message = str(error)
    assert "failed 2 times (max_failures=1)" in message
    assert message.count("rank 1") >= 2 and len(error.failures) == 1 and "died" in error.failures[0]
    assert len(trainer.strategy.restarts) == 1
    wait_for(lambda: not alive_worker_actors(), 30, "the failed fit's actors to be gone")


def test_step_checkpoints_resume_mid_epoch(tmp_path):
    pl.seed_everything(0)
    marker = tmp_path / "killed"
    # One worker: no survivor holds the state, so the restart reads the newest step checkpoint.
    trainer = _trainer(tmp_path, RayStrategy(num_workers=1, max_failures=1, recovery_checkpoint_every_n_steps=3))
    trainer.fit(FailsOnce(str(marker), epoch=1, batch=5, rank=0, checkpoint_step=12))
    (restart,) = trainer.strategy.restarts
    # Killed before epoch 1's 6th step (global step 14): the newest checkpoint was after step 12, mid-epoch 1.
    assert (restart.epoch, restart.global_step, restart.source) == (1, 12, "checkpoint")
    assert (trainer.current_epoch, trainer.global_step) == (3, 24)


def test_sigterm_to_a_worker_makes_rank_zero_checkpoint_before_the_restart(tmp_path, caplog):
    pl.seed_everything(0)
    marker = tmp_path / "terminated"
    trainer = _trainer(tmp_path, RayStrategy(num_workers=2, max_failures=1), max_epochs=2)
    model = FailsOnce(str(marker), how="sigterm", epoch=0, batch=1, step_s=0.5)
    model.hparams.size = 160  # 10 steps per epoch: time to checkpoint before the epoch ends
    with caplog.at_level("WARNING", logger="ray_lightning"):
        trainer.fit(model)
    (restart,) = trainer.strategy.restarts
    assert restart.reason == "preempted" and "received SIGTERM" in restart.cause
    signalled_at = int(marker.read_text())
    # Checkpointed within a few steps of the signal, mid-epoch 0: nothing before it is trained again.
    assert restart.epoch == 0 and signalled_at <= restart.global_step <= signalled_at + 4
    assert (trainer.current_epoch, trainer.global_step) == (2, 20)
    assert any("restarting the workers (1 of max_failures=1)" in r.getMessage() for r in caplog.records)


def test_max_failures_in_every_form(monkeypatch):
    assert RayStrategy(num_workers=2).max_failures == 0
    assert RayAccelerator(num_workers=2, max_failures=3).make_strategy().max_failures == 3
    monkeypatch.setenv("RAY_LIGHTNING_MAX_FAILURES", "2")
    monkeypatch.setenv("RAY_LIGHTNING_RECOVERY_CHECKPOINT_EVERY_N_STEPS", "50")
    strategy = RayStrategy(num_workers=2)
    assert (strategy.max_failures, strategy.recovery.every_n_steps) == (2, 50)
    assert RayStrategy(num_workers=2, max_failures=0).max_failures == 0, "the argument wins"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_failures": -1}, ValueError, "max_failures must be >= 0"),
        ({"max_failures": 1.5}, TypeError, "max_failures must be a whole number"),
        ({"max_failures": True}, TypeError, "max_failures must be a whole number"),
        ({"recovery_checkpoint_every_n_steps": 0}, ValueError, "recovery_checkpoint_every_n_steps must be >= 1"),
        ({"scale_up_timeout_s": -5}, ValueError, "scale_up_timeout_s must be a positive number"),
    ],
)
def test_bad_recovery_arguments_fail_in_the_constructor(kwargs, error, match):
    with pytest.raises(error, match=match):
        RayStrategy(num_workers=2, **kwargs)


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("RAY_LIGHTNING_MAX_FAILURES", "many", "RAY_LIGHTNING_MAX_FAILURES .* must be a whole number, got 'many'"),
        ("RAY_LIGHTNING_SPARE_WORKERS", "2", r"RAY_LIGHTNING_SPARE_WORKERS .* must be 0 or 1 \(off or on\), got '2'"),
    ],
)
def test_a_bad_environment_variable_names_itself(monkeypatch, name, value, match):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        RayStrategy(num_workers=2)


def test_horovod_restarts_like_ddp(tmp_path):
    pytest.importorskip("horovod.torch", reason="Horovod is not installed: `python3 dev.py test` builds it")
    from ray_lightning import HorovodRayStrategy

    pl.seed_everything(0)
    model = FailsOnce(str(tmp_path / "killed"), checkpoint_step=4)
    trainer = _trainer(tmp_path, HorovodRayStrategy(num_workers=2, max_failures=1))
    trainer.fit(model)
    (restart,) = trainer.strategy.restarts
    assert (restart.rank, restart.epoch, restart.global_step, restart.source) == (1, 1, 6, "memory")
    assert (trainer.current_epoch, trainer.global_step) == (3, 12)
    assert torch.equal(model.layer.weight, _reference_weights(tmp_path, HorovodRayStrategy))


def train_killed_once(config):
    from ray_lightning.tune import TuneReportCallback

    trainer = pl.Trainer(
        max_epochs=3,
        strategy=RayStrategy(num_workers=2, max_failures=1),
        callbacks=[TuneReportCallback({"loss": "val_loss"}, on="validation_end")],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(FailsOnce(config["marker"], checkpoint_step=4))
    with open(config["restarts"], "w") as f:
        f.write(" ".join(f"{r.rank}:{r.epoch}:{r.global_step}" for r in trainer.strategy.restarts))


def test_a_tune_trial_restarts_its_workers_within_its_own_bundles(tmp_path):
    from ray import tune

    from ray_lightning.tune import get_tune_resources

    analysis = tune.run(
        train_killed_once,
        config={"marker": str(tmp_path / "killed"), "restarts": str(tmp_path / "restarts")},
        resources_per_trial=get_tune_resources(num_workers=2),
        max_failures=1,
        storage_path=str(tmp_path / "results"),
        verbose=0,
    )
    (trial,) = analysis.trials
    assert trial.status == "TERMINATED" and trial.num_failures == 0, "the trial itself never failed"
    assert (tmp_path / "killed").exists()
    assert (tmp_path / "restarts").read_text() == "1:1:6"  # from the survivor's memory, after step 6
    # Epoch 0 reported before the failure; epochs 1 and 2 after the restart, which resumed at epoch 1.
    assert trial.last_result["training_iteration"] == 3


def test_a_sharded_fit_restarts_from_the_shards_each_rank_wrote_on_the_drivers_machine(tmp_path):
    from ray_lightning import RayFSDPStrategy

    pl.seed_everything(0)
    # Rank 1 dies once the epoch's checkpoint is complete (it is written beside training).
    model = FailsOnce(str(tmp_path / "killed"), checkpoint_step=4)
    # Every 4 steps: on each epoch's last batch, where the epoch's own checkpoint is taken instead.
    trainer = _trainer(tmp_path, RayFSDPStrategy(num_workers=2, max_failures=1, recovery_checkpoint_every_n_steps=4))
    trainer.fit(model)
    (restart,) = trainer.strategy.restarts
    # Killed before epoch 1's third step: the newest checkpoint was epoch 0's end (step 4), one shard file per rank
    # (torch's distributed checkpoint) in the driver's recovery folder, never gathered on rank 0.
    assert (restart.rank, restart.epoch, restart.global_step) == (1, 1, 4)
    files = (tmp_path / "killed.checkpoint").read_text().split()
    assert sorted(f for f in files if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"], files
    assert ".metadata" in files and "COMPLETE.json" in files, files
    assert (trainer.current_epoch, trainer.global_step) == (3, 12)
    assert torch.equal(model.layer.weight, _reference_weights(tmp_path, RayFSDPStrategy))


class NoticeOnRankOne(BoringModel):
    """Rank 1 gets a preemption notice at batch ``notice`` of epoch 0, the first time only (as launch.preemption hands
    one to the rank whose node goes). Each step takes ``step_s``, so the ranks agree on the notice within about a
    second's steps, well before the epoch ends."""

    def __init__(self, marker: str, notice: int = 10, step_s: float = 0.05):
        super().__init__(batch_size=2, size=160)  # 40 batches per rank and epoch on two workers
        self.marker, self.notice, self.step_s = marker, notice, step_s

    def training_step(self, batch, batch_idx):
        from ray_lightning import runtime
        from ray_lightning.home import storage

        time.sleep(self.step_s)  # a step that takes time, as a real one does
        first_time = not os.path.exists(self.marker)
        if self.global_rank == 1 and self.current_epoch == 0 and batch_idx == self.notice and first_time:
            Path(self.marker).touch()
            runtime.request_checkpoint("a test's spot notice")
        elif self.global_rank == 1 and batch_idx > self.notice and runtime.current_context().recovery.attempt == 0:
            newest = storage.newest_complete(runtime.current_context().recovery.storage_run)
            if newest is not None and newest.header["preemption"] and newest.header["world_size"] == 2:
                # The node "goes" only when the driver moves the workers: it stops this process (bounded).
                wait_for(lambda: False, 120, "the driver to move the workers after the preemption checkpoint")
        return super().training_step(batch, batch_idx)


def test_a_notice_on_one_rank_of_a_sharded_fit_checkpoints_every_rank_at_one_step(tmp_path):
    """A notice reaches one rank; without an all-reduce at every step the ranks still take the checkpoint together
    (each its shard, at one step, soon after), and the workers move and resume there."""
    from ray_lightning import RayFSDPStrategy

    model = NoticeOnRankOne(str(tmp_path / "noticed"))
    trainer = _trainer(tmp_path, RayFSDPStrategy(num_workers=2, max_failures=1), max_epochs=1, callbacks=[])
    trainer.fit(model)
    (restart,) = trainer.strategy.restarts
    assert restart.reason == "preempted" and "another rank's worker is going away" in restart.cause, restart
    # Agreed within about a second of steps after the notice (batch 10 ends step 11), before the epoch's end.
    assert (restart.epoch, restart.world_size) == (0, 2) and 11 <= restart.global_step < 40, restart
    assert trainer.global_step == 40, "resumed at that step, not at the start"


def test_the_callers_strategy_shows_the_restarts_of_its_rebuild():
    import lightning.pytorch as L

    strategy = RayStrategy(num_workers=2, max_failures=1)
    trainer = L.Trainer(strategy=strategy, logger=False)
    # A lightning.pytorch Trainer uses a rebuild of the pytorch_lightning strategy; the record is one list.
    assert trainer.strategy is not strategy and trainer.strategy.restarts is strategy.restarts
