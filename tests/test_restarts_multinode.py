"""Restarts when a node goes away: removed mid-epoch (``ray.cluster_utils.Cluster.remove_node``) or drained
for preemption with a deadline (Ray's own drain, as the autoscaler does for a spot instance)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import pytorch_lightning as pl
import ray
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from torch.nn import functional as F

from ray_lightning import RayStrategy
from ray_lightning.errors import WorkerDiedError
from tests.conftest import connected_cluster, wait_for
from tests.models import BoringModel, IndexedDataset

SLOT = {"CPU": 1, "slot": 1}


class MarksWhereItIs(BoringModel):
    """Rank ``rank`` writes its node id to ``marker`` at ``batch`` of ``epoch`` (first time only); steps are slow."""

    def __init__(self, marker: str, rank: int = 0, epoch: int = 1, batch: int = 1, step_s: float = 0.3, size=64):
        super().__init__(size=size)
        self.marker, self.mark_rank, self.mark_epoch, self.mark_batch, self.step_s = marker, rank, epoch, batch, step_s

    def training_step(self, batch, batch_idx):
        time.sleep(self.step_s)  # a step that takes time, as a real one does
        at = (self.global_rank, self.current_epoch, batch_idx) == (self.mark_rank, self.mark_epoch, self.mark_batch)
        if at and not os.path.exists(self.marker):
            with open(self.marker + ".partial", "w") as f:
                f.write(f"{ray.get_runtime_context().get_node_id()} {self.trainer.global_step}")
            os.replace(self.marker + ".partial", self.marker)
        return super().training_step(batch, batch_idx)


@pytest.fixture(scope="module")
def cluster():
    """A head the driver runs on (no worker slot) and three 1-slot nodes: two train, one is spare."""
    with connected_cluster(*({"num_cpus": 1, "resources": {"slot": 1}} for _ in range(3))) as cluster:
        yield cluster


@pytest.fixture
def three_worker_nodes(cluster):
    """Every test starts with three alive worker nodes (a test may lose one)."""
    alive = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("slot")]
    for _ in range(3 - len(alive)):
        cluster.add_node(num_cpus=1, resources={"slot": 1})
    wait_for(lambda: sum(bool(n["Alive"] and n["Resources"].get("slot")) for n in ray.nodes()) == 3, 60, "3 nodes")
    return cluster


def _trainer(directory, max_epochs: int = 3, **strategy_kwargs) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=max_epochs,
        strategy=RayStrategy(num_workers=2, resources_per_worker=SLOT, **strategy_kwargs),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=CSVLogger(directory / "logs"),
        callbacks=[ModelCheckpoint(dirpath=directory / "ckpt", save_top_k=-1)],
        log_every_n_steps=1,
    )


def _when_marked(marker, action) -> threading.Thread:
    """Run ``action(node id, global step)`` once the workers wrote ``marker``, in a thread of the test."""

    def run() -> None:
        wait_for(lambda: os.path.exists(marker), 300, f"the workers to write {marker}")
        node_id, step = open(marker).read().split()
        action(node_id, int(step))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _remove(cluster, node_id: str) -> None:
    (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
    cluster.remove_node(node)


def test_losing_rank_zeros_node_mid_epoch_restarts_and_keeps_every_finished_epoch(three_worker_nodes, tmp_path):
    cluster = three_worker_nodes
    reference_dir = tmp_path / "reference"
    pl.seed_everything(0)
    reference = MarksWhereItIs(str(tmp_path / "unused"), epoch=99)
    _trainer(reference_dir).fit(reference)

    pl.seed_everything(0)
    marker = str(tmp_path / "rank0-node")
    model = MarksWhereItIs(marker)
    remover = _when_marked(marker, lambda node, step: _remove(cluster, node))
    trainer = _trainer(tmp_path, max_failures=1)
    trainer.fit(model)
    remover.join(timeout=60)

    (restart,) = trainer.strategy.restarts
    # "node lost" once Ray marks the node dead; "worker died" if the actor's death is seen first; rank 1's
    # broken collective if its error arrives before rank 0's death.
    reasons = ("node lost", "worker died", "collective broken by a peer's loss")
    assert restart.rank in (0, 1) and restart.reason in reasons, restart
    if restart.source == "memory":  # rank 0's files fetched before its node went: rank 1's state
        assert restart.epoch == 1 and restart.steps_lost == 0, restart
    else:  # rank 0's files since epoch 0's checkpoint went with its node: from that checkpoint, as they are here
        assert (restart.epoch, restart.global_step, restart.source) == (1, 4, "checkpoint"), restart
    # The same training as without the failure: same weights, every epoch's checkpoint on this machine
    # (rank 0 wrote epoch 0's on the node that is gone), and the log of every step.
    assert torch.equal(model.layer.weight, reference.layer.weight)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
    assert str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt") in trainer.strategy.launcher.transferred_files
    MarksWhereItIs.load_from_checkpoint(str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt"))
    rows = (tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    assert len([r for r in rows[1:] if r.split(",")[-1] == ""]) == 12, "one row per training step"


def test_losing_a_node_without_max_failures_fails_naming_the_rank(three_worker_nodes, tmp_path):
    cluster = three_worker_nodes
    marker = str(tmp_path / "rank1-node")
    remover = _when_marked(marker, lambda node, step: _remove(cluster, node))
    trainer = _trainer(tmp_path)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1 .*died") as info:
        trainer.fit(MarksWhereItIs(marker, rank=1))
    remover.join(timeout=60)
    assert info.value.rank == 1 and trainer.strategy.restarts == []
    assert time.monotonic() - started < 240


class CountsSamples(BoringModel):
    """Writes what each micro-batch trained (epoch, step, sample ids, world size, attempt) into ``directory``;
    rank 0 waits at ``waits[(attempt, epoch, batch_idx)]`` for the test to change the cluster (bounded); ``batch_idx``
    None: at the attempt's first batch of that epoch."""

    def __init__(self, directory: str, waits: dict, size: int = 96):
        super().__init__(size=size)
        self.directory, self.waits = directory, waits

    def training_step(self, batch, batch_idx):
        from ray_lightning import runtime

        attempt = runtime.current_context().recovery.attempt
        epoch = self.current_epoch
        wait = self.waits.get((attempt, epoch, batch_idx)) or self.waits.pop((attempt, epoch, None), None)
        wait = wait if self.global_rank == 0 else None
        if wait is not None:
            asked, answered = (os.path.join(self.directory, name) for name in wait)
            with open(asked + ".partial", "w") as f:
                f.write(f"{ray.get_runtime_context().get_node_id()} {self.trainer.global_step}")
            os.replace(asked + ".partial", asked)
            # Or until the driver cancels the call (an elastic fit growing into its own bundles, launch.worker_group).
            done = lambda: os.path.exists(answered) or ray.get_runtime_context().is_canceled()  # noqa: E731
            wait_for(done, 120, f"the test to write {answered}")
        record = {
            "epoch": self.current_epoch,
            "step": self.trainer.global_step,
            "ids": batch[2].tolist(),
            "world": self.trainer.world_size,
            "attempt": attempt,
        }
        with open(os.path.join(self.directory, f"ids-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        return super().training_step(batch, batch_idx)


def _record_error(errors: list, function, *args) -> None:
    try:
        function(*args)
    except BaseException as error:  # noqa: BLE001 - the test thread raises it
        errors.append(error)


def _trained(directory, restarts) -> list[dict]:
    """The micro-batches the final weights went through: each attempt's up to the checkpoint the next resumed from."""
    records = [json.loads(line) for path in directory.glob("ids-*.jsonl") for line in path.read_text().splitlines()]
    ends = [r.global_step for r in restarts] + [float("inf")]
    return [r for r in records if r["step"] < ends[r["attempt"]]]


def _own_bundles_placed_again() -> bool:
    """Whether Ray placed every bundle of the fit's placement groups again (the only groups of this cluster's: the one
    it started in and the one it grew into)."""
    from ray.util.placement_group import placement_group_table

    groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
    return all(g["state"] == "CREATED" for g in groups) and sum(len(g["bundles"]) for g in groups) == 3


def test_an_elastic_fit_grows_to_three_shrinks_to_two_after_a_loss_and_grows_back_in_its_processes(
    three_worker_nodes, tmp_path
):
    cluster = three_worker_nodes
    spare = next(n for n in cluster.worker_nodes if n.node_id != ray.get_runtime_context().get_node_id())
    cluster.remove_node(spare)
    wait_for(lambda: sum(bool(n["Alive"] and n["Resources"].get("slot")) for n in ray.nodes()) == 2, 60, "2 nodes")
    seen = tmp_path / "seen"
    seen.mkdir()
    # Epoch 0 starts on 2 workers (rank 0 waits at its 2nd batch for a third node). At the next checkpoint (step 2)
    # the driver finds the node's room, reserves it and starts a worker there while the fit trains; rank 0 waits in
    # its 6th micro-batch (2 per step) until the driver, that worker up, cancels the call: the two running processes
    # leave it at a batch's start and go on on 3 from their memory. In epoch 1 a node other than rank 0's is lost at
    # step 5 (rank 0 goes on once it is removed). On two again, rank 0 waits at its first batch until a node is back,
    # Ray placed the lost bundle there and the driver started a worker in it: the fit grows into it the same way.
    waits = {
        (0, 0, 1): ("add", "added"),
        (0, 0, 5): ("grow", "grown"),
        (1, 1, 1): ("remove", "removed"),
        (2, 1, None): ("back", "placed"),
    }
    strategy = RayStrategy(
        num_workers=(2, 3),
        resources_per_worker=SLOT,
        max_failures=1,
        recovery_checkpoint_every_n_steps=2,
        grow_check_interval_s=0,
        placement_timeout_s=600,
    )
    model = CountsSamples(str(seen), waits)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    trainer = pl.Trainer(max_epochs=3, strategy=strategy, enable_progress_bar=False, logger=False)
    # The fit runs in a thread (as in a Tune trial): Ray's Cluster adds nodes from the main thread only.
    errors: list[BaseException] = []
    fit = threading.Thread(target=lambda: _record_error(errors, trainer.fit, model), daemon=True)
    fit.start()
    wait_for(lambda: (seen / "add").exists() or not fit.is_alive(), 300, "rank 0 to ask for a node")
    cluster.add_node(num_cpus=1, resources={"slot": 1})
    wait_for(lambda: sum(bool(n["Alive"] and n["Resources"].get("slot")) for n in ray.nodes()) == 3, 60, "3 nodes")
    (seen / "added").touch()
    wait_for(lambda: trainer.strategy.restarts or not fit.is_alive(), 300, "the driver to grow the fit")
    (seen / "grown").touch()
    wait_for(lambda: (seen / "remove").exists() or not fit.is_alive(), 300, "rank 0 to ask for a node's loss")
    if fit.is_alive():
        rank_zero_node = (seen / "remove").read_text().split()[0]
        lost = next(n for n in cluster.worker_nodes if n.node_id != rank_zero_node)
        cluster.remove_node(lost)  # its processes are killed
        (seen / "removed").touch()
    wait_for(lambda: (seen / "back").exists() or not fit.is_alive(), 300, "rank 0 to ask for a node back")
    if fit.is_alive():
        cluster.add_node(num_cpus=1, resources={"slot": 1})
        wait_for(_own_bundles_placed_again, 60, "Ray to place the lost bundle on the node that is back")
        # While rank 0 waits, the driver starts a worker in that bundle and grows the fit once it is up: it cancels
        # the call, and rank 0 stops waiting.
        wait_for(lambda: len(trainer.strategy.restarts) == 3 or not fit.is_alive(), 120, "the fit to grow back")
        (seen / "placed").touch()
    fit.join(timeout=600)
    assert not fit.is_alive() and not errors, errors

    grow, loss, regrow = trainer.strategy.restarts
    # Into the room found at step 2's checkpoint, in the running processes, at the step rank 0 was released into
    # (3), or at 2 when the cancel came before rank 0's 6th micro-batch (the 5th's gradient, a half step, is redone).
    assert (grow.reason, grow.world_size, grow.epoch, grow.source, grow.steps_lost) == ("grow", 3, 0, "memory", 0)
    assert grow.global_step in (2, 3), grow
    assert loss.reason != "grow" and loss.world_size == 2, loss
    # The survivors went on from their memory, in their processes: the step in flight (5, or 6 where the lost
    # node's worker was still there for step 5) was the only work lost.
    assert (loss.source, loss.epoch, loss.steps_lost) == ("memory", 1, 0) and loss.global_step in (5, 6), loss
    # Grown back into the fit's own bundle from the running processes' memory: nothing trained twice.
    assert (regrow.reason, regrow.world_size, regrow.source, regrow.steps_lost) == ("grow", 3, "memory", 0), regrow
    # Rank 0 waited at the first batch after the loss: the ranks left there, at the step the loss went on from.
    assert regrow.global_step == loss.global_step and regrow.epoch == 1, (loss, regrow)
    assert trainer.world_size == 3 and trainer.global_step == 12  # 4 steps an epoch on 3 and on 2 workers
    assert not torch.equal(model.layer.weight, before["layer.weight"])
    trained = _trained(seen, trainer.strategy.restarts)
    lines = {path.name: [json.loads(line) for line in path.read_text().splitlines()] for path in seen.glob("ids-*")}
    pids = {a: {name for name, records in lines.items() if any(r["attempt"] == a for r in records)} for a in range(4)}
    assert len(pids[0]) == 2 and pids[0] < pids[1], "the first grow kept both running processes and added one"
    # The attempt after the loss runs in the survivors' processes; one still inside the broken step after 5 s is
    # replaced (here the lost node's process can outlive its raylet for a while, holding its connections open).
    assert len(pids[1]) == 3 and len(pids[2]) == 2 and pids[2] & pids[1], "a survivor's process went on"
    assert len(pids[3]) == 3 and pids[2] < pids[3], "the grow kept both running processes and added one"
    on_two = grow.global_step * 4  # micro-batch records: 2 ranks x 2 accumulated, then 3 x 1, per step
    worlds = [2] * on_two + [3] * (3 * (4 - grow.global_step))
    assert [r["world"] for r in sorted(trained, key=lambda r: r["step"]) if r["epoch"] == 0] == worlds
    assert {r["world"] for r in trained if r["step"] >= regrow.global_step} == {3}
    for epoch in range(3):
        ids = sorted(i for r in trained if r["epoch"] == epoch for i in r["ids"])
        assert ids == list(range(96)), f"epoch {epoch}: every sample once"
    for step in range(12):  # keep_global_batch: 3 x 8 on three workers, 2 x 6 x 2 accumulated on two
        assert sum(len(r["ids"]) for r in trained if r["step"] == step) == 24, step
    _assert_an_unbroken_fits_weights(model, before, trained, steps=12, per_epoch=4)


def _assert_an_unbroken_fits_weights(model: BoringModel, before: dict, trained: list[dict], steps: int, per_epoch: int):
    """Every step trained the global batch an uninterrupted fit trains (the ``DistributedSampler``'s shuffled order
    of its epoch, seed 0), and plain SGD on those batches in this process ends at the fit's weights."""
    data = IndexedDataset(model.hparams.size, model.hparams.dim, seed=0)
    replay = BoringModel(size=model.hparams.size)
    replay.load_state_dict(before)
    sgd = torch.optim.SGD(replay.parameters(), lr=model.hparams.lr)
    batch = model.hparams.size // per_epoch
    for step in range(steps):
        epoch, k = divmod(step, per_epoch)
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch)).tolist()
        ids = sorted(i for r in trained if r["step"] == step for i in r["ids"])
        assert ids == sorted(order[k * batch : (k + 1) * batch]), f"step {step}: an uninterrupted fit's batch"
        sgd.zero_grad()
        F.mse_loss(replay(data.x[ids]), data.y[ids]).backward()
        sgd.step()
    for name, value in replay.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-4, atol=1e-5, msg=name)


def _drain(node_id: str, deadline_s: float) -> None:
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    client = GcsClient(ray.get_runtime_context().gcs_address)
    deadline_ms = int((time.time() + deadline_s) * 1000)
    accepted, reason = client.drain_node(
        node_id, autoscaler_pb2.DRAIN_NODE_REASON_PREEMPTION, "spot instance reclaimed", deadline_ms
    )
    assert accepted, reason


def test_a_node_drained_for_preemption_gets_a_checkpoint_before_it_goes(three_worker_nodes, tmp_path):
    marker = str(tmp_path / "rank1-node")
    drained: list[tuple[str, int, float]] = []

    def drain(node: str, step: int) -> None:
        drained.append((node, step, time.monotonic()))
        _drain(node, deadline_s=60)

    remover = _when_marked(marker, drain)
    # Drained at the second step of epoch 0 (of 16): restarted mid-epoch 0, then the fit trains on to its end.
    trainer = _trainer(tmp_path, max_epochs=2, max_failures=1)
    trainer.fit(MarksWhereItIs(marker, rank=1, epoch=0, batch=1, size=256))
    remover.join(timeout=60)

    (restart,) = trainer.strategy.restarts
    ((node, step, _),) = drained
    assert restart.reason == "preempted" and "is being drained" in restart.cause and node[:8] in restart.cause
    # Rank 0 checkpointed mid-epoch 0, a few steps after the drain: the restart loses only those.
    assert restart.epoch == 0 and step <= restart.global_step <= step + 8
    assert (trainer.current_epoch, trainer.global_step) == (2, 32)
