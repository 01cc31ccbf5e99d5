"""The pure parts of restarts (no Ray): the final error, the staging mirror, a continued CSV log, random states."""

from __future__ import annotations

import os

import torch
from pytorch_lightning.loggers import CSVLogger

from ray_lightning._lightning.loggers import continue_csv_log
from ray_lightning.config.restarts import RecoverySettings
from ray_lightning.errors import WorkerDiedError
from ray_lightning.home.files import StagingMirror, to_staged
from ray_lightning.home.landing import WriteScope
from ray_lightning.home.recovery import random_states, set_random_states
from ray_lightning.launch.actor import NodeInfo
from ray_lightning.launch.failures import Failure, Kind
from ray_lightning.launch.placement import Placement
from ray_lightning.launch.recovery import Recovery
from tests.conftest import wait_for


def test_errors_keep_their_failures_when_pickled():
    import pickle

    error = WorkerDiedError("died", rank=2, preempted=True)
    error.failures = ["first", "second"]
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.rank, copy.preempted, copy.failures) == (WorkerDiedError, 2, True, ["first", "second"])


def test_the_final_error_names_every_failure(tmp_path):
    history: list = []
    recovery = Recovery(RecoverySettings(max_failures=1), WriteScope(), history=history)
    node = NodeInfo("node-2", "10.0.0.2", 4711, [])
    first = WorkerDiedError("ray_lightning worker rank 1 (node 10.0.0.2) died unexpectedly", rank=1)
    failure = Failure(Kind.WORKER_DIED, first, 1, node)
    restart = recovery.record_restart(failure)
    assert (restart.number, restart.rank, restart.node, restart.reason) == (1, 1, "10.0.0.2", "worker died")
    assert restart.failed_at == failure.at, "when the driver learned of it, not when the restart was recorded"
    second = WorkerDiedError("ray_lightning worker rank 0 (node 10.0.0.3) died unexpectedly", rank=0)
    final = recovery.final_error(second)
    assert type(final) is WorkerDiedError and final.rank == 0 and final.failures == [str(first)]
    assert "failed 2 times (max_failures=1)" in str(final) and "10.0.0.2" in str(final) and "10.0.0.3" in str(final)
    assert [r.rank for r in recovery.restarts] == [1] and history == recovery.restarts


def test_without_restarts_the_error_is_raised_unchanged():
    recovery = Recovery(RecoverySettings(), WriteScope(), history=[])
    error = WorkerDiedError("died", rank=1)
    assert recovery.final_error(error) is error


def test_the_mirror_sends_what_changed_and_what_was_removed(tmp_path):
    staging = str(tmp_path / "staging")
    driver_path = str(tmp_path / "run" / "ckpt" / "epoch=0.ckpt")
    staged = to_staged(driver_path, staging)
    os.makedirs(os.path.dirname(staged))
    with open(staged, "wb") as f:
        f.write(b"zero")
    mirror = StagingMirror(staging)
    assert mirror.changes() == ({driver_path: b"zero"}, [])
    assert mirror.changes() == ({}, []), "unchanged files are not sent again"
    os.remove(staged)
    assert mirror.changes() == ({}, [driver_path])


def test_a_restarted_csv_log_keeps_the_rows_before_the_checkpoint(tmp_path):
    first = CSVLogger(tmp_path)
    first.log_metrics({"loss": 1.0}, step=0)
    first.log_metrics({"loss": 0.5}, step=1)
    first.log_metrics({"loss": 0.4}, step=2)  # after the checkpoint: logged again after the restart
    first.save()
    restarted = CSVLogger(tmp_path, version=first.version)  # a new process, as a restarted rank 0
    continue_csv_log(restarted, before_step=2)
    restarted.log_metrics({"loss": 0.3, "val_loss": 0.2}, step=2)
    restarted.save()
    with open(os.path.join(restarted.log_dir, "metrics.csv")) as f:
        lines = f.read().splitlines()
    assert lines == ["loss,step,val_loss", "1.0,0,", "0.5,1,", "0.3,2,0.2"]


def test_random_states_come_back():
    states = random_states()
    expected = torch.rand(3)
    torch.rand(5)
    set_random_states(states)
    assert torch.equal(torch.rand(3), expected)


def test_a_sharded_fits_ranks_agree_on_a_preemption_about_once_a_second_not_at_every_step(monkeypatch):
    """The one-number all-reduce that lets one rank's notice reach all: at each of the first batches, then at the
    interval rank 0 measured (broadcast once, so every rank agrees at the same batches)."""
    from types import SimpleNamespace

    from ray_lightning.home import recovery

    broadcasts, decisions = [], []

    def broadcast(value, src):
        broadcasts.append((value, src))
        return 25  # rank 0's interval, whatever this rank measured

    def reduce_boolean_decision(decision, all):
        decisions.append(callback._batches)
        return False

    strategy = SimpleNamespace(broadcast=broadcast, reduce_boolean_decision=reduce_boolean_decision)
    trainer = SimpleNamespace(strategy=strategy, global_step=0)
    callback = recovery.RecoveryCheckpoints(None, None, collective=True)
    monkeypatch.setattr(recovery._lightning, "is_last_batch", lambda trainer: True)  # no checkpoint: the schedule only
    for _ in range(100):
        callback.on_train_batch_end(trainer, None, None, None, 0)
    first = list(range(1, recovery.CALIBRATION_BATCHES + 1))
    assert decisions == first + [25, 50, 75, 100]
    assert len(broadcasts) == 1 and broadcasts[0][1] == 0 and broadcasts[0][0] >= 1


def _progress_after(trainer, ready: int, processed: int, completed: int, epochs_before: int = 0) -> None:
    """The training batch counters of an epoch (``epochs_before`` epochs of 4 batches before it)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for counter, offset in ((progress.current, 0), (progress.total, 4 * epochs_before)):
        counter.ready, counter.started = ready + offset, ready + offset
        counter.processed, counter.completed = processed + offset, completed + offset


def _counts(trainer) -> list[tuple[int, int, int, int]]:
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return [(c.ready, c.started, c.processed, c.completed) for c in (progress.current, progress.total)]


def test_a_failed_batchs_counters_settle_after_the_last_completed_step():
    import pytorch_lightning as pl

    from ray_lightning._lightning import settle_failed_batch

    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    # Failed in the step of the epoch's 3rd batch: every counter after the 2nd, so Lightning resumes at the 3rd.
    _progress_after(trainer, ready=3, processed=2, completed=2, epochs_before=1)
    settle_failed_batch(trainer)
    assert _counts(trainer) == [(2, 2, 2, 2), (6, 6, 6, 6)]
    # Failed after the step, in on_train_batch_end: Lightning's own checkpoint there, which its restart counts.
    _progress_after(trainer, ready=3, processed=3, completed=2)
    settle_failed_batch(trainer)
    assert _counts(trainer) == [(3, 3, 3, 2), (3, 3, 3, 2)]
    # A step every 2 batches: failed in the 4th batch, the 3rd only accumulated its gradient: back to after the 2nd.
    trainer.accumulate_grad_batches = 2
    _progress_after(trainer, ready=4, processed=3, completed=3)
    settle_failed_batch(trainer)
    assert _counts(trainer) == [(2, 2, 2, 2), (2, 2, 2, 2)]


def test_a_failure_outside_a_training_batch_keeps_no_state(monkeypatch):
    import pytorch_lightning as pl

    from ray_lightning.home import snapshot

    monkeypatch.setattr(snapshot, "_held", None)
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    kept = snapshot.MemorySnapshot(attempt=2)
    trainer.callbacks.append(kept)
    snapshot.keep_after_failure(trainer)  # before any batch (setting up, validating): only the step reached
    header = snapshot.header()
    assert (header.attempt, header.global_step, header.held) == (2, 0, False)
    snapshot.forget()
    assert snapshot.header() is None


def test_a_state_that_cannot_be_kept_leaves_the_fits_own_error_to_the_driver(monkeypatch):
    import pytorch_lightning as pl

    from ray_lightning.home import snapshot

    monkeypatch.setattr(snapshot, "_held", None)
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    kept = snapshot.MemorySnapshot(attempt=0)

    def fails(trainer):
        raise RuntimeError("a user's on_save_checkpoint failed")

    monkeypatch.setattr(kept, "keep", fails)
    trainer.callbacks.append(kept)
    snapshot.keep_after_failure(trainer)  # does not raise: the worker then re-raises the fit's error
    assert not snapshot.header().held


class _ScriptedPlacement(Placement):
    """Where a group's bundles are, as Ray would say after a node was lost: one answer per read."""

    def __init__(self, nodes: list[str], answers: list[list[str | None]]) -> None:
        super().__init__(None, list(range(len(nodes))), list(nodes))
        self._answers = answers

    def nodes_now(self) -> list[str | None]:
        return self._answers.pop(0) if len(self._answers) > 1 else self._answers[0]


def _group_on(nodes: list[str], answers: list[list[str | None]]):
    from ray_lightning.environment import assign_ranks
    from ray_lightning.launch.worker_group import WorkerGroup

    group = WorkerGroup(_ScriptedPlacement(nodes, answers), assign_ranks(nodes))
    group.actors = [f"actor on {node}" for node in nodes]  # not Ray actors: ray.kill of them is suppressed
    return group


def test_an_elastic_group_goes_on_without_a_lost_nodes_workers_and_gives_ranks_again():
    group = _group_on(["a", "b", "c"], [["a", None, "c"]])
    kept = group._placed_again(["ref a", "ref b", "ref c"], wait_s=0, min_workers=2)
    assert kept == ["ref a", "ref c"] and group.actors == ["actor on a", "actor on c"]
    assert group.placement.bundles == [0, 2] and [r.global_rank for r in group.ranks] == [0, 1]
    assert [r.node_rank for r in group.ranks] == [0, 1]


def test_a_group_below_its_minimum_or_of_fixed_size_does_not_go_on_without_a_node():
    assert _group_on(["a", "b", "c"], [["a", None, None]])._placed_again(["r"] * 3, 0, min_workers=2) is None
    assert _group_on(["a", "b"], [["a", None]])._placed_again(["r"] * 2, 0, min_workers=None) is None


def test_a_fixed_size_group_waits_until_ray_placed_the_lost_bundle_again_and_moves_its_worker_there():
    # Rank 0's node is lost; Ray places its bundle on the spare node "c" at the third read.
    group = _group_on(["a", "b"], [[None, "b"], [None, "b"], ["c", "b"]])
    kept = group._placed_again(["ref 0", "ref 1"], wait_s=60, min_workers=None)
    assert kept == ["ref 0", "ref 1"] and group.placement.nodes == ["c", "b"]
    assert [(r.global_rank, r.node_rank) for r in group.ranks] == [(0, 0), (1, 1)]


def test_a_dead_workers_place_goes_to_its_nodes_spare_while_it_lives_else_to_a_new_process(ray_local, monkeypatch):
    import ray
    from ray.exceptions import RayActorError

    @ray.remote(num_cpus=0)
    class Spare:
        def node_info(self) -> str:
            return "here"

    live, dead = Spare.remote(), Spare.remote()
    started = {"a": (live, live.node_info.remote()), "b": (dead, dead.node_info.remote())}
    ray.get([ref for _, ref in started.values()])
    ray.kill(dead)  # after its start, as Ray's memory monitor kills an idle process

    def gone() -> bool:
        try:
            ray.get(dead.node_info.remote(), timeout=10)
        except RayActorError:
            return True
        return False

    wait_for(gone, 30, "the killed spare to be gone")
    group = _group_on(["a", "b", "c"], [["a", "b", "c"]])
    monkeypatch.setattr(group, "_new_actor", lambda i, spare=False: f"new actor {i}")  # it needs a placement group
    group.spares = started
    for i in range(3):
        group._replace(i)
    assert group.actors == [live, "new actor 1", "new actor 2"]
    assert group.spares_taken == 1 and group.spares == {}, "a spare is taken once; the next attempt starts others"
    ray.kill(live)


def test_a_lost_nodes_spare_is_dropped_with_its_workers():
    group = _group_on(["a", "b", "c"], [["a", None, "c"]])
    group.spares = {"a": ("spare on a", "ref"), "b": ("spare on b", "ref")}
    group._placed_again(["ref a", "ref b", "ref c"], wait_s=0, min_workers=2)
    assert list(group.spares) == ["a"]
