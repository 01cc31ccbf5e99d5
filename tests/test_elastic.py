"""Elastic workers, ``num_workers=(min, max)``: the arguments, the batch policy, the position across a resize.

The multi-node resizes (start on 2, grow to 3, go on with 2 after a lost node) are in tests/test_restarts_multinode.py.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DistributedSampler

from ray_lightning import HorovodRayStrategy, RayAccelerator, RayStrategy
from ray_lightning.config.elastic import ElasticSettings, worker_range
from ray_lightning.config.resources import resolve_worker_resources
from ray_lightning.data.elastic import ContinuingSampler, global_batch_split
from ray_lightning.errors import RayWorkerError, WorkerDiedError, WorkersGrowError
from ray_lightning.launch.elastic import Growth
from ray_lightning.launch.failures import Failure, Kind, classify, decide
from tests.conftest import wait_for
from tests.models import BoringModel

needs_horovod = pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="Horovod is not installed")


@pytest.mark.parametrize(
    ("num_workers", "error", "match"),
    [
        ((3, 2), ValueError, r"1 <= min <= max, got \(3, 2\)"),
        ((0, 2), ValueError, "1 <= min <= max"),
        ((2, "3"), TypeError, "pair"),
        ((1, 2, 3), TypeError, "pair"),
        (True, TypeError, "int"),
    ],
)
def test_bad_worker_ranges_fail_in_the_constructor(num_workers, error, match):
    with pytest.raises(error, match=match):
        RayStrategy(num_workers=num_workers)


def test_every_form_takes_a_range_and_a_fixed_size_is_not_elastic(monkeypatch):
    assert RayStrategy(num_workers=(2, 4)).workers.elastic == ElasticSettings(2, 4)
    assert RayStrategy(num_workers=[2, 4], batch_policy="leave").workers.elastic.batch_policy == "leave"
    assert RayStrategy(num_workers=(3, 3)).workers.elastic is None and RayStrategy(num_workers=3).num_workers == 3
    assert RayAccelerator(num_workers=(1, 2)).make_strategy().workers.elastic.max_workers == 2
    monkeypatch.setenv("RAY_LIGHTNING_NUM_WORKERS", "2,3")
    monkeypatch.setenv("RAY_LIGHTNING_BATCH_POLICY", "scale_lr")
    monkeypatch.setenv("RAY_LIGHTNING_GROW_CHECK_INTERVAL_S", "5")
    assert RayStrategy().workers.elastic == ElasticSettings(2, 3, "scale_lr", 5.0)
    assert RayStrategy(num_workers=4).workers.elastic is None  # the argument wins
    monkeypatch.setenv("RAY_LIGHTNING_NUM_WORKERS", "two")
    with pytest.raises(ValueError, match="RAY_LIGHTNING_NUM_WORKERS .*'two'"):
        RayStrategy()


def test_bad_elastic_arguments_name_themselves():
    with pytest.raises(ValueError, match="batch_policy must be one of 'keep_global_batch', 'scale_lr', 'leave'"):
        RayStrategy(num_workers=(1, 2), batch_policy="linear")
    with pytest.raises(ValueError, match="grow_check_interval_s"):
        RayStrategy(num_workers=(1, 2), grow_check_interval_s=-1)
    with pytest.raises(ValueError, match="num_hosts"):
        HorovodRayStrategy(num_workers=(1, 2), num_hosts=2)
    assert worker_range((1, 2)) == (1, 2) and worker_range(4) == (4, 4)


@pytest.mark.parametrize(
    ("global_batch", "world", "most", "split"),
    [
        (24, 3, 8, (8, 1)),  # the reference size: the user's batch
        (24, 2, 8, (6, 2)),  # 12 a worker would grow the batch: accumulate instead
        (32, 2, 8, (8, 2)),  # 4 x 8 -> 2 x 8 x 2
        (30, 4, 10, None),  # 4 does not divide 30
    ],
)
def test_the_global_batch_is_kept_without_growing_a_workers_batch(global_batch, world, most, split):
    assert global_batch_split(global_batch, world, most) == split


@pytest.mark.parametrize(("old", "new"), [(3, 2), (2, 3), (2, 2)])
def test_a_resumed_epoch_deals_the_rest_of_its_order_over_the_new_ranks(old, new):
    data, batch, done = list(range(96)), 4, 3  # 3 batches a rank trained on `old` ranks
    before = [DistributedSampler(data, old, r, shuffle=True, seed=7) for r in range(old)]
    for sampler in before:
        sampler.set_epoch(1)
    trained = [i for sampler in before for i in list(sampler)[: done * batch]]
    after = [
        ContinuingSampler(DistributedSampler(data, new, r, shuffle=True, seed=7), len(trained), 1) for r in range(new)
    ]
    rest = [i for sampler in after for i in sampler]
    assert sorted(trained + rest) == data, "every sample of the epoch once"
    assert all(len(s) == 96 // new for s in after), "the loader's length stays a whole epoch's"
    if old == new:  # the same ranks get what they would have had without the restart
        assert [list(s) for s in after] == [list(s)[done * batch :] for s in before]
    after[0].set_epoch(2)
    plain = DistributedSampler(data, new, 0, shuffle=True, seed=7)
    plain.set_epoch(2)
    assert list(after[0]) == list(plain), "the next epoch is whole"


def test_growing_is_a_restart_max_failures_does_not_count():
    grow = classify(WorkersGrowError("room for 3", 3), {}, set())
    decision = decide(grow, restarts_done=5, max_failures=0)
    assert grow.kind is Kind.GROW and decision.restart and decision.keep_processes, "in the running processes"
    died = Failure(Kind.NODE_LOST, WorkerDiedError("gone", rank=1), rank=1)
    assert not decide(died, restarts_done=1, max_failures=1).restart
    assert isinstance(WorkersGrowError("x", 2), RayWorkerError)


class _Checkpoint:
    def __init__(self, epoch: int, global_step: int, reason: str = "epoch boundary") -> None:
        self.epoch, self.global_step, self.reason = epoch, global_step, reason


def _probe_reserves(monkeypatch, free) -> list:
    """The probe finds ``free(most)`` workers' room and reserves it as the group "pg<n>"; what is given back, listed."""
    import ray_lightning.launch.elastic as elastic
    from ray_lightning.launch import placement as placement_module

    monkeypatch.setattr(elastic, "free_room", lambda request, most: free(most))
    monkeypatch.setattr(elastic, "placed_at_once", lambda request: f"pg{request.num_workers}")
    removed: list = []
    monkeypatch.setattr(placement_module, "remove_placement_group", removed.append)
    return removed


def test_no_growth_at_the_most_workers_nor_after_the_last_epoch_nor_between_checkpoints(monkeypatch):
    probed = []
    _probe_reserves(monkeypatch, lambda most: probed.append(most) or most)
    growth = Growth(ElasticSettings(2, 3, grow_check_interval_s=0), resolve_worker_resources(2), 3, -1)
    no_room, nowhere = (lambda: 0), [].append
    assert growth.check(3, _Checkpoint(1, 4), no_room, True, nowhere) is None  # at max: nothing asked of the cluster
    assert growth.check(2, None, no_room, True, nowhere) is None  # no checkpoint yet to grow from
    assert growth.check(2, _Checkpoint(3, 12), no_room, True, nowhere) is None  # the last epoch's: nothing to train
    stepped = Growth(ElasticSettings(2, 3, grow_check_interval_s=0), resolve_worker_resources(2), -1, 10)
    assert stepped.check(2, _Checkpoint(2, 10, "every 2 steps"), no_room, True, nowhere) is None
    assert probed == [] and growth._probe is None and stepped._probe is None


def test_growth_is_checked_at_a_steps_checkpoint_not_at_a_preemptions(monkeypatch):
    """Sharded: the probe starts at a step's checkpoint, and the fit grows at the first checkpoint that arrives once
    the new worker is up, mid-epoch, in its running processes."""
    import ray_lightning.launch.elastic as elastic

    monkeypatch.setattr(elastic, "HELD_POLL_S", 0.0)
    _probe_reserves(monkeypatch, lambda most: most)  # the cluster holds what is asked
    reserved: list = []
    spare = lambda: len(reserved)  # noqa: E731 - the reserved group's worker is up at once
    growth = Growth(ElasticSettings(2, 3, grow_check_interval_s=0), resolve_worker_resources(2), 3, -1)
    preempted = _Checkpoint(1, 6, "preemption: node draining")
    assert growth.check(2, preempted, spare, False, reserved.append) is None  # that attempt stops anyway
    assert growth._probe is None
    assert growth.check(2, _Checkpoint(1, 6, "every 2 steps"), spare, False, reserved.append) is None  # probe starts
    growth.wait_for_probe(10)
    error = growth.check(2, _Checkpoint(1, 7, "every 2 steps"), spare, False, reserved.append)  # mid-epoch: grows
    assert reserved == ["pg1"]
    assert error is not None and error.size == 3, error
    assert "epoch 1, step 7, in the running workers with new ones beside them, on 3" in str(error), error


def test_the_drivers_loop_goes_on_while_the_cluster_is_probed_for_room(monkeypatch):
    """A probe that waits for Ray (seconds when there is no room) runs beside the loop that runs rank 0's calls;
    its answer is taken at a later message, only for the size it was asked for."""
    import threading

    import ray_lightning.launch.elastic as elastic

    monkeypatch.setattr(elastic, "HELD_POLL_S", 0.0)
    answer = threading.Event()
    probed = []

    def free(most):
        probed.append(most)
        assert answer.wait(30), "the test never let the probe answer"
        return 1

    removed = _probe_reserves(monkeypatch, free)
    reserved: list = []
    spare = lambda: len(reserved)  # noqa: E731
    growth = Growth(ElasticSettings(2, 4, grow_check_interval_s=0), resolve_worker_resources(2), 5, -1)
    assert growth.check(2, _Checkpoint(1, 4), spare, True, reserved.append) is None  # returned; the probe waits
    assert growth.check(2, _Checkpoint(1, 5), spare, True, reserved.append) is None and probed == [2], "one probe"
    answer.set()
    growth.wait_for_probe(10)
    assert growth.check(3, _Checkpoint(1, 6), spare, True, reserved.append) is None, "not an answer for another size"
    assert removed == ["pg1"], "room for the wrong number of workers is given back"
    growth.wait_for_probe(10)  # the one that check started, for 3
    assert growth.check(2, _Checkpoint(1, 7), spare, True, reserved.append) is None, "nor that one's for 2"
    growth.wait_for_probe(10)
    assert probed == [2, 1, 2] and reserved == []
    error = growth.check(2, _Checkpoint(2, 8), spare, True, reserved.append)
    assert reserved == ["pg1"]
    assert error is not None and error.size == 3 and "next step" in str(error), error
    growth.close()


def test_a_fit_held_in_memory_grows_into_its_own_bundles_once_their_workers_are_up(monkeypatch):
    """DDP's ranks hold the state: the grow into the fit's own bundles placed again (a lost node's, placed by Ray
    again) waits for the workers started there (counted by ``spare``), not for a new checkpoint nor for
    ``grow_check_interval_s``, at the next batch; a sharded fit's, from the checkpoint."""
    import ray_lightning.launch.elastic as elastic

    monkeypatch.setattr(elastic, "HELD_POLL_S", 0.0)
    _probe_reserves(monkeypatch, lambda most: 0)
    up = [0]
    growth = Growth(ElasticSettings(2, 3, grow_check_interval_s=3600), resolve_worker_resources(2), 3, -1)
    checkpoint = _Checkpoint(1, 4)
    assert growth.check(2, checkpoint, lambda: up[0], True, [].append) is None  # its worker is still starting
    up[0] = 1
    error = growth.check(2, checkpoint, lambda: up[0], True, [].append)
    assert error is not None and error.size == 3 and "next step" in str(error), error
    sharded = Growth(ElasticSettings(2, 3, grow_check_interval_s=3600), resolve_worker_resources(2), 3, -1)
    error = sharded.check(2, checkpoint, lambda: 1, False, [].append)
    assert error is not None and "step 4, in the running workers" in str(error), error
    growth.close()


def test_a_fit_held_in_memory_reserves_the_room_it_finds_and_grows_into_it_once_its_workers_are_up(monkeypatch):
    """Room beyond the fit's own bundles (a node that joined): the probe reserves it (a placement group), the group
    starts workers there (``reserve``, then ``spare``), and the fit grows into it in its running processes."""
    import ray_lightning.launch.elastic as elastic
    from ray_lightning.launch import placement as placement_module

    monkeypatch.setattr(elastic, "HELD_POLL_S", 0.0)
    monkeypatch.setattr(elastic, "free_room", lambda request, most: most)
    placed = []
    monkeypatch.setattr(elastic, "placed_at_once", lambda request: placed.append(request.num_workers) or "pg")
    removed = []
    monkeypatch.setattr(placement_module, "remove_placement_group", removed.append)
    reserved: list = []
    up = [0]
    spare = lambda: up[0] if reserved else 0  # noqa: E731 - the reserved group's workers, once up
    growth = Growth(ElasticSettings(2, 3, grow_check_interval_s=0), resolve_worker_resources(2), 3, -1)
    assert growth.check(2, _Checkpoint(1, 4), spare, True, reserved.append) is None  # the probe starts
    growth.wait_for_probe(10)
    assert growth.check(2, _Checkpoint(1, 5), spare, True, reserved.append) is None  # reserved, its worker starts
    assert reserved == ["pg"] and placed == [1]
    assert growth.check(2, _Checkpoint(1, 6), spare, True, reserved.append) is None  # no second probe meanwhile
    assert growth._probe is None and placed == [1]
    up[0] = 1
    error = growth.check(2, _Checkpoint(1, 6), spare, True, reserved.append)
    assert error is not None and error.size == 3, error
    growth.close()
    assert removed == [], "the group holds the room it grew into"
    # A room found as the call ends is given back.
    late = Growth(ElasticSettings(2, 3, grow_check_interval_s=0), resolve_worker_resources(2), 3, -1)
    assert late.check(2, _Checkpoint(1, 4), lambda: 0, True, [].append) is None
    late.close()
    assert removed == ["pg"]


class _Group:
    """A placement group as :class:`~ray_lightning.launch.placement.Placement` sees one: an id."""

    def __init__(self, name: str) -> None:
        self.id = name


def _cluster_says(monkeypatch, where: dict, alive: set) -> None:
    """Ray's placement-group table (``where``: group id -> bundle -> node, every group placed) and its alive nodes."""
    from ray_lightning.launch import placement as placement_module

    table = lambda pg: {"bundles_to_node_id": where[pg.id], "state": "CREATED"}  # noqa: E731
    monkeypatch.setattr(placement_module, "placement_group_table", table)
    monkeypatch.setattr(placement_module.ray, "nodes", lambda: [{"NodeID": n, "Alive": True} for n in alive])


def test_a_placement_spans_the_group_it_grew_into_and_gives_back_those_no_worker_uses(monkeypatch):
    from ray_lightning.launch import placement as placement_module
    from ray_lightning.launch.placement import Placement

    main, grown, spare_room = _Group("main"), _Group("grown"), _Group("spare")
    where = {"main": {0: "a", 1: "b", 2: "c"}, "grown": {0: "d"}, "spare": {0: "e"}}
    _cluster_says(monkeypatch, where, {"a", "b", "c", "d", "e"})
    removed = []
    monkeypatch.setattr(placement_module, "remove_placement_group", lambda pg: removed.append(pg.id))
    placement = Placement(main, [0, 1, 2], ["a", "b", "c"])
    placement.keep([0, 2], ["a", "c"])  # bundle 1's node was lost
    assert (placement.bundles, placement.nodes, [g.id for g in placement.groups]) == ([0, 2], ["a", "c"], ["main"] * 2)
    placement.extend(grown)
    placement.extend(spare_room)
    # Bundle 1 placed again, and both reserved groups: room, in order.
    assert [(g.id, b, n) for g, b, n in placement.placed_unused()] == [
        ("main", 1, "b"),
        ("grown", 0, "d"),
        ("spare", 0, "e"),
    ]
    placement.add(grown, 0, "d")
    assert placement.nodes_now() == ["a", "c", "d"]
    placement.release_unused()
    assert removed == ["spare"] and placement.extensions == [grown]
    placement.release()
    assert removed == ["spare", "main", "grown"]


def test_a_grow_adds_no_more_workers_than_it_was_decided_for(monkeypatch):
    """Room placed beyond what the grow counted (a lost node's bundles placed again meanwhile): the most is kept."""
    from ray_lightning.environment import assign_ranks
    from ray_lightning.launch.placement import Placement
    from ray_lightning.launch.worker_group import WorkerGroup

    main, grown = _Group("main"), _Group("grown")
    where = {"main": {0: "a", 1: "b", 2: "c"}, "grown": {0: "d"}}
    _cluster_says(monkeypatch, where, {"a", "b", "c", "d"})
    placement = Placement(main, [0], ["a"])
    placement.extend(grown)
    group = WorkerGroup(placement, assign_ranks(placement.nodes))
    group.actors = ["actor 0"]
    monkeypatch.setattr(group, "_new_actor", lambda i, spare=False, slot=None: f"actor {i}")
    monkeypatch.setattr(placement, "release_unused", lambda: None)
    group._add_placed(most=2)  # 3 bundles unused: the main group's 1 and 2, the grown group's 0
    assert group.actors == ["actor 0", "actor 1", "actor 2"] and len(group.ranks) == 3
    assert [(g.id, b) for g, b in zip(placement.groups, placement.bundles)] == [("main", 0), ("main", 1), ("main", 2)]


def test_room_reserved_in_an_attempt_that_failed_does_not_stop_the_next_from_probing(monkeypatch):
    import ray_lightning.launch.elastic as elastic

    monkeypatch.setattr(elastic, "free_room", lambda request, most: most)
    monkeypatch.setattr(elastic, "placed_at_once", lambda request: _Group("room"))
    growth = Growth(ElasticSettings(2, 3, grow_check_interval_s=0), resolve_worker_resources(2), 3, -1)
    reserved: list = []
    assert growth.check(2, _Checkpoint(1, 4), lambda: 0, True, reserved.append) is None  # the probe starts
    growth.wait_for_probe(10)
    assert growth.check(2, _Checkpoint(1, 5), lambda: 0, True, reserved.append) is None and len(reserved) == 1
    assert growth.check(2, _Checkpoint(1, 6), lambda: 0, True, reserved.append) is None
    assert growth._probe is None, "no probe while the reserved room's worker starts"
    growth.attempt_started()  # the attempt failed: its group, and the room with it, were released
    assert growth.check(2, _Checkpoint(1, 7), lambda: 0, True, reserved.append) is None
    assert growth._probe is not None, "the next attempt asks the cluster again"
    growth.close()


class LogsLearningRate(BoringModel):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__(lr=0.3, batch_size=batch_size, size=48)

    def training_step(self, batch, batch_idx):
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"], reduce_fx="max")
        self.log("world", float(self.trainer.world_size), reduce_fx="max")
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


# Two of these fit the session's Ray (4 custom_accel): a (2, 3) fit starts on 2.
TWO_FIT = {"CPU": 1, "custom_accel": 2}


def test_scale_lr_trains_fewer_workers_at_a_proportionally_lower_rate(ray_local):
    strategy = RayStrategy(num_workers=(2, 3), resources_per_worker=TWO_FIT, batch_policy="scale_lr")
    trainer = pl.Trainer(max_epochs=1, strategy=strategy, enable_progress_bar=False, logger=False)
    trainer.fit(LogsLearningRate())
    assert trainer.callback_metrics["world"].item() == 2 and trainer.world_size == 2
    assert trainer.callback_metrics["lr"].item() == pytest.approx(0.3 * 2 / 3)
    assert trainer.strategy.restarts == []


def test_a_global_batch_two_workers_cannot_keep_fails_naming_the_sizes(ray_local):
    strategy = RayStrategy(num_workers=(2, 3), resources_per_worker=TWO_FIT)
    trainer = pl.Trainer(max_epochs=1, strategy=strategy, enable_progress_bar=False, logger=False)
    sizes = r"global batch 5 x 1 \(accumulate_grad_batches\) x 3 workers on 2 workers"
    with pytest.raises(RayWorkerError, match=sizes):
        trainer.fit(LogsLearningRate(batch_size=5))


class LogsBatch(LogsLearningRate):
    def training_step(self, batch, batch_idx):
        self.log("batch", float(len(batch[0])), reduce_fx="max")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("strategy_class", "batch", "accumulation"),
    [("RayStrategy", 6, 2), pytest.param("HorovodRayStrategy", 12, 1, marks=needs_horovod)],
)
def test_two_of_three_workers_keep_the_global_batch_of_three(ray_local, strategy_class, batch, accumulation):
    """3 x 8 = 24 a step: 2 x 6 x 2 accumulated under DDP; Horovod fixes the accumulation, so 2 x 12."""
    cls = getattr(__import__("ray_lightning"), strategy_class)
    strategy = cls(num_workers=(2, 3), resources_per_worker=TWO_FIT)
    trainer = pl.Trainer(max_epochs=1, strategy=strategy, enable_progress_bar=False, logger=False)
    trainer.fit(LogsBatch())
    assert trainer.world_size == 2 and trainer.callback_metrics["batch"].item() == batch
    assert trainer.global_step == 48 // 24, "as many optimizer steps as on three workers"
    assert trainer.callback_metrics["lr"].item() == pytest.approx(0.3), "keep_global_batch leaves the rate"


class WaitsForRoom(LogsBatch):
    """On two workers, rank 0 waits at its first batch (bounded) until the test freed room for a third, and at epoch
    1's first batch until the worker the driver started in that room is up (epochs are short: the fit would otherwise
    end before it is); every rank writes its world size and pid at each batch."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory

    def training_step(self, batch, batch_idx):
        if self.trainer.world_size == 2 and self.global_rank == 0 and (self.current_epoch, batch_idx) == (0, 0):
            (Path(self.directory) / "asked").touch()
            wait_for(lambda: (Path(self.directory) / "freed").exists(), 120, "the test to free room for a worker")
        if self.trainer.world_size == 2 and self.global_rank == 0 and (self.current_epoch, batch_idx) == (1, 0):
            wait_for(lambda: (Path(self.directory) / "up").exists(), 120, "the third worker to be up")
        with open(Path(self.directory) / "pids", "a") as f:
            f.write(f"{self.trainer.world_size} {os.getpid()}\n")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("strategy_class", "source"),
    [("RayFSDPStrategy", "checkpoint"), pytest.param("HorovodRayStrategy", "memory", marks=needs_horovod)],
)
def test_an_elastic_fit_grows_from_two_to_three_workers_in_its_processes(
    ray_local, no_waiting_workers, tmp_path, caplog, strategy_class, source
):
    """Room for a third worker (another job's reservation ends) during epoch 0: the driver reserves it and starts a
    worker there while the fit trains on. Sharded (FSDP2): at the first epoch end after that worker is up, the fit
    goes on on three from the checkpoint the two ranks wrote there (a shard each); Horovod: at the next batch, from
    the ranks' memory. Both in their running processes."""
    from ray.util.placement_group import placement_group, remove_placement_group

    import ray_lightning

    other_job = placement_group([{"custom_accel": 2}])  # of the session's 4: room for two one-accel workers
    assert other_job.wait(60)
    strategy = getattr(ray_lightning, strategy_class)(
        num_workers=(2, 3), resources_per_worker={"CPU": 1, "custom_accel": 1}, grow_check_interval_s=0
    )
    trainer = pl.Trainer(max_epochs=4, strategy=strategy, enable_progress_bar=False, logger=False)
    model = WaitsForRoom(str(tmp_path))
    before = model.layer.weight.detach().clone()
    errors: list[BaseException] = []
    fit = threading.Thread(target=lambda: _recorded(errors, trainer.fit, model), daemon=True)
    fit.start()
    try:
        wait_for(lambda: (tmp_path / "asked").exists() or not fit.is_alive(), 120, "rank 0 to start on two")
    finally:
        remove_placement_group(other_job)
    (tmp_path / "freed").touch()
    caplog.set_level(logging.INFO, logger="ray_lightning.launch.elastic")
    up = lambda: any("new worker(s) up" in r.getMessage() for r in caplog.records)  # noqa: E731 - the driver's
    wait_for(lambda: up() or not fit.is_alive(), 120, "the driver to see a third worker up")
    (tmp_path / "up").touch()
    fit.join(timeout=300)
    assert not fit.is_alive() and not errors, errors
    (grow,) = trainer.strategy.restarts
    assert (grow.reason, grow.world_size, grow.source) == ("grow", 3, source), grow
    if source == "checkpoint":
        # Decided at epoch 1's end, the first checkpoint after the third worker was up; it goes on from the newest
        # when the ranks left the call (epoch 2's end, when its two short steps ran before the cancel reached a batch).
        assert grow.epoch in (2, 3) and grow.global_step == 2 * grow.epoch, grow
        assert "at the next recovery checkpoint" in caplog.text
    else:  # at a batch of epoch 1, where rank 0 waited for the third worker, or soon after; no step trained twice
        assert grow.epoch >= 1 and grow.steps_lost == 0, grow
        assert "at the next batch" in caplog.text
    assert trainer.world_size == 3 and trainer.global_step == 8, "2 steps of 24 samples an epoch on 2 and on 3"
    assert trainer.callback_metrics["batch"].item() == 8 and not torch.equal(model.layer.weight, before)
    pids = [line.split() for line in (tmp_path / "pids").read_text().splitlines()]
    on_two, on_three = ({pid for world, pid in pids if world == w} for w in ("2", "3"))
    assert len(on_two) == 2 and len(on_three) == 3 and on_two < on_three, "the two processes went on, one beside"


class EndsAsTheGrowIsDecided(BoringModel):
    """Rank 0, past its last batch, tells the test so (a file), then stays in the call until the driver's cancel
    reached it, as when a grow is decided while the fit ends."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory

    def on_train_end(self) -> None:
        ended = Path(self.directory) / "past the last batch"
        if ended.exists():  # an attempt after the first (the test then fails on its restarts)
            return
        ended.touch()
        import ray

        wait_for(ray.get_runtime_context().is_canceled, 60, "the driver to cancel the call")


def test_a_grow_decided_as_the_fit_ends_keeps_its_results_and_starts_no_other_attempt(
    ray_local, no_waiting_workers, tmp_path, monkeypatch
):
    """The driver decides a grow (room is up) when the ranks are past their last batch: they end the call as it is
    cancelled, and the fit returns what they trained, with no attempt that trains nothing after it."""
    import ray_lightning.launch.launcher as launcher

    ended = tmp_path / "past the last batch"
    decided: list[WorkersGrowError] = []

    def grow_once() -> WorkersGrowError | None:  # Growth.check's answer once room is up
        if decided or not ended.exists():
            return None
        decided.append(WorkersGrowError("ray_lightning: the cluster can hold 2 workers now", 2))
        return decided[0]

    monkeypatch.setattr(launcher, "stop_check", lambda *args: grow_once)
    trainer = pl.Trainer(
        max_epochs=1,
        limit_train_batches=4,
        strategy=RayStrategy(num_workers=(1, 2), resources_per_worker={"CPU": 1, "custom_accel": 4}),
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
    )
    model = EndsAsTheGrowIsDecided(str(tmp_path))
    before = model.layer.weight.detach().clone()
    trainer.fit(model)
    assert decided and trainer.strategy.restarts == [], trainer.strategy.restarts
    # 4 batches, accumulated 2 a step: 1 worker of at most 2 keeps the global batch of 2.
    assert trainer.global_step == 2 and not torch.equal(model.layer.weight, before), "the ranks' training came home"


def _recorded(errors: list, function, *args) -> None:
    try:
        function(*args)
    except BaseException as error:  # noqa: BLE001 - the test's thread raises it
        errors.append(error)
