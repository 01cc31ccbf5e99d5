"""Lightning Fabric on Ray actors: real Fabric loops, real Ray, gloo, FSDP2, checked as a Fabric user would.

A Fabric user writes the loop; these functions are such loops, module-level so that Ray (and Fabric's own
``ddp_spawn``, the reference) can import them in the workers.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import signal
import time
import warnings

import lightning as L
import lightning_fabric
import pytest
import pytorch_lightning as pl
import torch
from lightning.fabric.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ray_lightning import (
    ClusterResourceError,
    HorovodRayStrategy,
    RayAccelerator,
    RayDeepSpeedStrategy,
    RayFSDPStrategy,
    RayModelParallelStrategy,
    RayStrategy,
    RayWorkerError,
)
from ray_lightning.errors import WorkerHangError
from tests.conftest import alive_worker_actors, connected_cluster, session_pythonpath, wait_for
from tests.models import BoringModel

pytestmark = pytest.mark.usefixtures("ray_local")

STEPS = 4


def _data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def train_ddp(fabric, lr: float) -> dict:
    """A plain loop: seeded model, distributed sampler, backward, clipping, a reduced metric; rank 0's weights."""
    fabric.seed_everything(0)
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(_data(), batch_size=4, shuffle=True))
    for batch_idx, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=10.0)
        optimizer.step()
        optimizer.zero_grad()
        if batch_idx + 1 == STEPS:
            break
    mean_loss = fabric.all_reduce(loss.detach(), reduce_op="mean")
    # Arrays, not tensors: ddp_spawn's return queue would pass tensors as shared memory its exiting children close.
    return {"state": {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}, "loss": float(mean_loss)}


def test_a_fabric_loop_on_ray_trains_as_under_fabrics_own_ddp_spawn():
    ours = L.Fabric(strategy=RayStrategy(num_workers=2)).launch(train_ddp, 0.05)
    theirs = L.Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn").launch(train_ddp, 0.05)
    assert ours["state"].keys() == theirs["state"].keys()
    for name, array in ours["state"].items():
        torch.testing.assert_close(torch.from_numpy(array), torch.from_numpy(theirs["state"][name]), msg=name)
    assert ours["loss"] == pytest.approx(theirs["loss"])
    torch.manual_seed(0)
    assert not torch.equal(_net().state_dict()["0.weight"], torch.from_numpy(ours["state"]["0.weight"])), "untrained"


def use_everything(fabric, out_dir: str) -> dict:
    """What Fabric offers inside the function: collectives, the sampler's shares, loggers, save/load, init_module."""
    with fabric.init_module(empty_init=True):
        model = _net()
    fabric.seed_everything(1)
    model.apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(20.0)), batch_size=5))
    seen = torch.cat([batch for (batch,) in loader])
    x = torch.randn(4, 4)
    with fabric.no_backward_sync(model, enabled=True):
        fabric.backward(model(x).sum())  # accumulated locally, no gradient all-reduce
    fabric.backward(model(x).sum())
    optimizer.step()
    fabric.log("value", float(fabric.global_rank + 1), step=0)
    fabric.barrier()
    fabric.print(f"fabric.print from rank {fabric.global_rank}")
    fabric.save(os.path.join(out_dir, "state.ckpt"), {"model": model, "optimizer": optimizer, "step": 7})
    restored = fabric.load(os.path.join(out_dir, "state.ckpt"))
    return {
        "world_size": fabric.world_size,
        "seen": fabric.all_gather(seen).flatten().tolist(),
        "broadcast": fabric.broadcast(os.getpid(), src=fabric.world_size - 1),
        "sum": fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)), reduce_op="sum").item(),
        "pid": os.getpid(),
        "restored_step": restored["step"],
        "cwd": os.getcwd(),
    }


def _csv_values(root, key: str = "value") -> list[str]:
    (path,) = root.rglob("metrics.csv")
    with open(path, newline="") as f:
        return [row[key] for row in csv.DictReader(f)]


def test_everything_fabric_offers_works_in_the_launched_function_of_both_packages(tmp_path, capfd):
    strategy = RayStrategy(num_workers=2)
    fabric = L.Fabric(strategy=strategy, loggers=CSVLogger("logs", name="run"))
    first = fabric.launch(use_everything, "ckpt")
    assert capfd.readouterr().out.count("fabric.print from rank 0") == 1, "printed once, before launch returned"
    assert first["world_size"] == 2
    assert sorted(first["seen"]) == [float(i) for i in range(20)], "every sample once across the ranks"
    assert first["sum"] == 3.0 and first["restored_step"] == 7
    assert first["broadcast"] != first["pid"], "rank 1's value reached rank 0"
    # Relative paths are the driver's: the checkpoint and the logs are in this test's directory.
    assert first["cwd"] == str(tmp_path)
    checkpoint = torch.load(tmp_path / "ckpt" / "state.ckpt", weights_only=False)
    assert checkpoint["step"] == 7 and "0.weight" in checkpoint["model"]
    assert _csv_values(tmp_path / "logs") == ["1.0"], "rank 0 logged once"
    second = fabric.launch(use_everything, "ckpt2")
    assert second["pid"] == first["pid"], "the second launch of the same shape ran on the workers left waiting"
    assert _csv_values(tmp_path / "logs") == ["1.0", "1.0"], "the same logger went on in the same file"
    # The other Lightning package's Fabric, by registry name (one worker, the default).
    third = lightning_fabric.Fabric(strategy="ray").launch(use_everything, "ckpt3")
    assert third["world_size"] == 1 and third["sum"] == 1.0 and third["restored_step"] == 7


def autocast_dtype(fabric, *, trainer: str) -> str:
    with fabric.autocast():
        return f"{nn.Linear(4, 1)(torch.randn(2, 4)).dtype} {trainer}"


def test_mixed_precision_follows_the_workers_device_not_the_drivers():
    # Fabric builds its bf16 plugin on the driver for CUDA (the strategy decides the device): a CPU worker
    # must autocast on the CPU, through the same plugin object Fabric and its modules hold.
    fabric = L.Fabric(strategy=RayStrategy(num_workers=2), precision="bf16-mixed")
    # (and a keyword of the function named like the Trainer's launcher argument reaches it)
    assert fabric.launch(autocast_dtype, trainer="mine") == "torch.bfloat16 mine"


def fails_on_rank_one(fabric) -> None:
    fabric.barrier()
    if fabric.global_rank == 1:
        raise ValueError("rank one's loop broke")


def test_an_error_in_the_function_names_its_rank_and_traceback():
    fabric = L.Fabric(strategy=RayStrategy(num_workers=2, keep_workers_alive_s=0))
    with pytest.raises(RayWorkerError) as caught:
        fabric.launch(fails_on_rank_one)
    message = str(caught.value)
    assert caught.value.rank == 1 and "rank one's loop broke" in message and "fails_on_rank_one" in message


def test_what_cannot_work_is_refused_before_any_worker_starts():
    before = len(alive_worker_actors())
    fabric = L.Fabric(strategy=RayStrategy(num_workers=2))
    with pytest.raises(RuntimeError, match=r"fabric\.launch\(train, \*args\)"):
        fabric.launch()
    with pytest.raises(TypeError, match="HorovodRayStrategy has no Fabric form"):
        L.Fabric(strategy=HorovodRayStrategy(num_workers=2))
    with pytest.warns(UserWarning, match=r"accelerator='cuda'.* is ignored"):
        L.Fabric(strategy=RayStrategy(num_workers=2), accelerator="cuda")
    classic = L.Fabric(accelerator=RayAccelerator(num_workers=2))
    assert type(classic.strategy).__name__ == "RayFabricDDPStrategy" and classic.strategy.num_workers == 2
    impossible = RayStrategy(num_workers=2, resources_per_worker={"CPU": 1, "tpu_v9": 1})
    with pytest.raises(ClusterResourceError, match="which no node in the Ray cluster has"):
        L.Fabric(strategy=impossible).launch(train_ddp, 0.1)
    assert len(alive_worker_actors()) <= before, "no worker started"


def hangs_on_rank_one(fabric) -> None:
    fabric.barrier()
    if fabric.global_rank == 1:
        time.sleep(3600)
    fabric.barrier()


def test_a_stuck_rank_is_named_within_the_progress_bound():
    fabric = L.Fabric(strategy=RayStrategy(num_workers=2, progress_timeout_s=10, keep_workers_alive_s=0))
    with pytest.raises(WorkerHangError) as caught:
        fabric.launch(hangs_on_rank_one)
    assert caught.value.ranks == [1], str(caught.value)
    assert "hangs_on_rank_one" in str(caught.value)


def resumes_from_its_checkpoint(fabric, marker: str) -> dict:
    """The documented pattern: load the last ``fabric.save`` if there is one, continue from its step."""
    fabric.seed_everything(0)
    model = _net()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if os.path.exists("last.ckpt"):
        fabric.load("last.ckpt", state)
    started_at = state["step"]
    x, y = _data(8).tensors
    while state["step"] < 6:
        if state["step"] == 3 and fabric.global_rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        fabric.log("step_logged", float(state["step"]), step=state["step"])
        state["step"] += 1
        fabric.save("last.ckpt", state)
    return {"started_at": started_at, "step": state["step"]}


def test_a_killed_worker_reruns_the_function_which_continues_from_its_last_save(tmp_path):
    strategy = RayStrategy(num_workers=2, max_failures=1, keep_workers_alive_s=0)
    logger = CSVLogger("logs", name="run", flush_logs_every_n_steps=1)
    result = L.Fabric(strategy=strategy, loggers=logger).launch(resumes_from_its_checkpoint, str(tmp_path / "killed"))
    assert (tmp_path / "killed").exists(), "the worker was never killed"
    (restart,) = strategy.restarts
    assert restart.rank == 1 and restart.reason == "worker died"
    assert result == {"started_at": 3, "step": 6}
    # The rows the first run wrote are kept, the rerun's follow them: every step once.
    assert _csv_values(tmp_path / "logs", "step_logged") == [f"{float(step)}" for step in range(6)]


def train_sharded(fabric, save_to: str | None, load_from: str | None) -> dict:
    from torch.distributed.tensor import DTensor

    fabric.seed_everything(0)
    with fabric.init_module(empty_init=False):
        model = _net()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if load_from:
        fabric.load(load_from, state)
    x, y = _data(8).tensors
    for _ in range(2):
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
    if save_to:
        fabric.save(save_to, state)
    weight = model.module[0].weight
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in model.state_dict().items()}
    return {"sharded": isinstance(weight, DTensor), "local_rows": weight.to_local().shape[0], "state": full,
            "step": state["step"]}  # fmt: skip


def test_fsdp2_saves_a_sharded_state_that_loads_on_another_number_of_workers(tmp_path):
    two = L.Fabric(strategy=RayFSDPStrategy(num_workers=2, state_dict_type="sharded"))
    first = two.launch(train_sharded, "sharded-ckpt", None)
    assert first["sharded"] and first["local_rows"] == 4, "an (8, 4) weight split over 2 ranks"
    assert (tmp_path / "sharded-ckpt").is_dir(), "a torch.distributed.checkpoint directory"
    one = L.Fabric(strategy=RayFSDPStrategy(num_workers=1, state_dict_type="sharded"))
    resumed = one.launch(train_sharded, None, "sharded-ckpt")
    assert resumed["step"] == 4
    reference = L.Fabric(strategy=RayFSDPStrategy(num_workers=1, state_dict_type="sharded"))
    straight = reference.launch(train_sharded, None, None)
    # Two more steps from the loaded state (weights and Adam's moments) differ from two steps from the start.
    assert not torch.allclose(resumed["state"]["0.weight"], straight["state"]["0.weight"])
    assert not torch.allclose(resumed["state"]["0.weight"], first["state"]["0.weight"])


def shard_linears(module: nn.Module, mesh) -> nn.Module:
    """A Fabric user's ``parallelize_fn``: FSDP2 on each Linear and the whole, over the data-parallel dimension."""
    from torch.distributed.fsdp import fully_shard

    for layer in module:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"])
    return fully_shard(module, mesh=mesh["data_parallel"])


def trains_saves_loads(fabric, path: str) -> dict:
    fabric.seed_everything(0)
    model = _net()
    if isinstance(fabric.strategy, L.fabric.strategies.DeepSpeedStrategy):
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    else:  # FSDP2: the optimizer is made over the sharded parameters
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05))
    x, y = _data(8).tensors
    losses = []
    for _ in range(3):
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)
    return {"losses": losses, "step": state["step"], "strategy": type(fabric.strategy).__name__}


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: RayModelParallelStrategy(num_workers=2, parallelize_fn=shard_linears), id="model_par"),
        pytest.param(lambda: RayDeepSpeedStrategy(num_workers=2, stage=3), id="deepspeed", marks=pytest.mark.skipif(
            importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")),
    ],
)  # fmt: skip
def test_model_parallel_and_deepspeed_run_a_fabric_loop_and_its_checkpoints(tmp_path, make):
    result = L.Fabric(strategy=make()).launch(trains_saves_loads, "ckpt")
    assert result["losses"][-1] < result["losses"][0], result
    assert result["step"] == 3, "fabric.load restored the saved state"
    # A checkpoint directory with every rank's part (torch.distributed.checkpoint's, DeepSpeed's).
    parts = {p.name for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
    assert any("0" in name for name in parts) and len(parts) >= 2, parts


def test_model_parallel_without_parallelize_fn_is_refused_for_fabric_and_with_it_for_the_trainer():
    with pytest.raises(TypeError, match="needs parallelize_fn=fn"):
        L.Fabric(strategy=RayModelParallelStrategy(num_workers=2))
    trainer = pl.Trainer(strategy=RayModelParallelStrategy(num_workers=2, parallelize_fn=shard_linears))
    with pytest.raises(TypeError, match="parallelize_fn=...\\) is for Lightning Fabric"):
        trainer.fit(BoringModel())


def writes_on_rank_zero(fabric) -> dict:
    import ray

    fabric.save("out/state.ckpt", {"step": 3, "rank": fabric.global_rank})
    # Every rank reads what rank 0 saved, as on one machine: rank 1 shares rank 0's node.
    read = fabric.all_gather(torch.tensor(fabric.load("out/state.ckpt")["step"])).tolist()
    fabric.log("value", 2.0, step=0)
    return {"node": ray.get_runtime_context().get_node_id(), "read": read}


def saves_sharded(fabric) -> bool:
    from torch.distributed.tensor import DTensor

    model = fabric.setup_module(_net())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.save("sharded", {"model": model, "optimizer": optimizer})
    return isinstance(model.module[0].weight, DTensor)


@pytest.mark.timeout(600)
def test_files_ranks_write_on_other_nodes_come_home(tmp_path):
    node = {"num_cpus": 2, "resources": {"elsewhere": 2, "spread": 1}}
    env = {"env_vars": {"PYTHONPATH": session_pythonpath()}}
    with connected_cluster(node, runtime_env=env, head_resources={"spread": 1}):
        import ray

        driver_node = ray.get_runtime_context().get_node_id()
        strategy = RayStrategy(num_workers=2, resources_per_worker={"CPU": 1, "elsewhere": 1}, keep_workers_alive_s=0)
        fabric = L.Fabric(strategy=strategy, loggers=CSVLogger("logs", name="run"))
        result = fabric.launch(writes_on_rank_zero)
        assert result["node"] != driver_node, "rank 0 ran on the other node"
        assert result["read"] == [3, 3]
        home = tmp_path / "out" / "state.ckpt"
        assert str(home) in fabric.strategy.launcher.transferred_files, "sent home, not written through a shared disk"
        # FSDP2 with one rank on each node: each rank's part of the sharded checkpoint comes home beside the other's.
        spread = {"CPU": 1, "spread": 1}
        sharded = RayFSDPStrategy(num_workers=2, resources_per_worker=spread, state_dict_type="sharded")
        sharded_fabric = L.Fabric(strategy=sharded)
        assert sharded_fabric.launch(saves_sharded)
        came_home = {os.path.basename(p) for p in sharded_fabric.strategy.launcher.transferred_files}
    assert torch.load(home, weights_only=False) == {"step": 3, "rank": 0}
    assert _csv_values(tmp_path / "logs") == ["2.0"]
    parts = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert parts == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"], parts
    # What the rank on the other node wrote (its part; rank 0's metadata too if it was that one) was staged and sent
    # home; the rank on the driver's node wrote in place.
    assert came_home and came_home < set(parts) and any(p.endswith(".distcp") for p in came_home), came_home


def reports_to_tune(fabric, scale: float, directory: str) -> int:
    from ray_lightning.tune import report

    total = float(fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)), reduce_op="sum"))
    path = os.path.join(directory, "fabric-tune.ckpt")
    for step in range(1, 4):
        fabric.save(path, {"step": step})
        if report(fabric, {"total": total * scale, "step": step}, checkpoint_path=path):
            return step  # Tune stopped the trial: every rank leaves the loop here
    return 3


def fabric_trial(config):
    L.Fabric(strategy=RayStrategy(num_workers=2)).launch(reports_to_tune, config["scale"], config["dir"])


@pytest.mark.usefixtures("no_waiting_workers")
def test_a_fabric_launch_in_a_tune_trial_reports_metrics_and_checkpoints_from_its_function(tmp_path):
    from ray import tune

    from ray_lightning.tune import MARKER_FILE, get_tune_resources

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        analysis = tune.run(
            fabric_trial,
            config={"scale": 10.0, "dir": str(tmp_path)},
            resources_per_trial=get_tune_resources(num_workers=2),
            stop={"training_iteration": 2},
            storage_path=str(tmp_path / "tune"),
            verbose=0,
        )
    (trial,) = analysis.trials
    assert trial.last_result["total"] == 30.0 and trial.last_result["step"] == 2, trial.last_result
    saved = torch.load(os.path.join(trial.checkpoint.path, "fabric-tune.ckpt"), weights_only=False)
    assert saved == {"step": 2}
    # Rank 0 copied the file into Tune's folder itself: nothing of it went through the trial's process.
    with open(os.path.join(trial.checkpoint.path, MARKER_FILE)) as f:
        assert json.load(f) == {"filename": "fabric-tune.ckpt", "written_by": "ranks"}
    wait_for(lambda: not alive_worker_actors(), 30, "the trial's workers to be stopped")
