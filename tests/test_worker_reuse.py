"""Workers kept alive between calls: the next fit of the process runs on the same processes, safely."""

from __future__ import annotations

import os
import sys

import pytest
import pytorch_lightning as pl
import ray
import torch

import ray_lightning
from ray_lightning import HorovodRayStrategy, RayStrategy, RayWorkerError
from tests.conftest import alive_worker_actors, wait_for, wait_for_no_placement_groups
from tests.models import BoringModel, Recorder, read_records
from tests.test_training import FailingModel

pytestmark = pytest.mark.usefixtures("ray_local")


class SeenEnvironment(pl.Callback):
    """Records, in each worker, an environment variable forwarded from the driver (PL_*)."""

    def __init__(self) -> None:
        self.value: str | None = "unset"

    def on_fit_start(self, trainer, pl_module):
        self.value = os.environ.get("PL_REUSE_TEST")

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _fit(model, tmp_path, name: str, strategy=None, **kwargs) -> pl.Trainer:
    trainer = pl.Trainer(
        max_epochs=1,
        strategy=strategy or RayStrategy(num_workers=2),
        callbacks=[Recorder(tmp_path, name), *kwargs.pop("callbacks", [])],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        **kwargs,
    )
    trainer.fit(model)
    return trainer


def _pids(tmp_path, name: str) -> list[int]:
    return [r["pid"] for r in read_records(tmp_path, name, "start")]


def test_the_next_fit_runs_on_the_same_workers_with_a_new_process_group(tmp_path, monkeypatch):
    model = BoringModel()
    monkeypatch.setenv("PL_REUSE_TEST", "first")
    first_env = SeenEnvironment()
    _fit(model, tmp_path, "first", callbacks=[first_env])
    after_first = model.layer.weight.clone()
    assert len(alive_worker_actors()) == 2, "the workers should wait for the next call"

    monkeypatch.delenv("PL_REUSE_TEST")
    second_env = SeenEnvironment()
    trainer = _fit(model, tmp_path, "second", callbacks=[second_env])

    assert _pids(tmp_path, "second") == _pids(tmp_path, "first")
    first, second = read_records(tmp_path, "first", "start"), read_records(tmp_path, "second", "start")
    assert [r["global_rank"] for r in second] == [0, 1] and {r["world_size"] for r in second} == {2}
    assert {r["backend"] for r in second} == {"gloo"}
    assert first[0]["master"] != second[0]["master"], "each call meets at its own rendezvous"
    # Training went on from the first fit's weights, and the driver has the result.
    assert not torch.equal(after_first, model.layer.weight)
    assert trainer.current_epoch == 1 and "train_loss" in trainer.callback_metrics
    # The environment of the first call did not leak into the second.
    assert (first_env.value, second_env.value) == ("first", None)

    ray_lightning.release_idle_workers()
    wait_for(lambda: not alive_worker_actors(), 30, "the released workers to be gone")


class SeenNiceness(pl.Callback):
    """Records, in each worker, the niceness of every thread of its process while it trains."""

    def __init__(self) -> None:
        self.values: list[int] = []

    def on_train_start(self, trainer, pl_module):
        threads = os.listdir("/proc/self/task")
        self.values = sorted({os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in threads})

    def state_dict(self):
        return {"values": self.values}

    def load_state_dict(self, state):
        self.values = state["values"]


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or os.geteuid() != 0, reason="a worker may lower its niceness only as root"
)
def test_workers_train_at_the_drivers_niceness_and_wait_at_rays(tmp_path):
    seen = SeenNiceness()
    _fit(BoringModel(), tmp_path, "fit", callbacks=[seen])
    # Ray starts its workers at RAY_worker_niceness (15); during the call they take the driver's, as
    # Lightning's ddp_spawn ranks would.
    assert seen.values == [os.getpriority(os.PRIO_PROCESS, 0)]
    rays = int(os.environ.get("RAY_worker_niceness", "15"))
    for pid in _pids(tmp_path, "fit"):
        wait_for(lambda pid=pid: os.getpriority(os.PRIO_PROCESS, pid) == rays, 30, "the idle worker at Ray's niceness")


def test_test_and_predict_reuse_the_fits_workers(tmp_path):
    model = BoringModel()
    trainer = _fit(model, tmp_path, "fit")
    assert trainer.test(model)[0]["test_loss"] > 0
    predictions = trainer.predict(model)
    assert sum(len(p["index"]) for p in predictions) == 64
    assert len(alive_worker_actors()) == 2


def test_kept_workers_stop_after_keep_workers_alive_s(tmp_path):
    _fit(BoringModel(), tmp_path, "fit", strategy=RayStrategy(num_workers=2, keep_workers_alive_s=1))
    wait_for(lambda: not alive_worker_actors(), 30, "the idle workers to stop after 1 s")
    wait_for_no_placement_groups(30, "their placement group to be removed")


def test_a_different_request_replaces_the_waiting_workers(tmp_path):
    model = BoringModel()
    _fit(model, tmp_path, "two", strategy=RayStrategy(num_workers=2))
    _fit(model, tmp_path, "one", strategy=RayStrategy(num_workers=1))
    assert not set(_pids(tmp_path, "one")) & set(_pids(tmp_path, "two"))
    assert len(alive_worker_actors()) == 1


MODULE_SOURCE = """
from tests.models import BoringModel


class EditedModel(BoringModel):
    pass
"""


def test_changed_code_gets_fresh_workers(tmp_path, monkeypatch):
    code = tmp_path / "code"
    code.mkdir()
    module_file = code / "reuse_edited_module.py"
    module_file.write_text(MODULE_SOURCE)
    monkeypatch.syspath_prepend(str(code))  # forwarded to the workers on this machine
    from reuse_edited_module import EditedModel

    model = EditedModel()
    _fit(model, tmp_path, "before")
    _fit(model, tmp_path, "unchanged")
    assert _pids(tmp_path, "unchanged") == _pids(tmp_path, "before")

    module_file.write_text(MODULE_SOURCE + "\n# edited\n")
    stat = module_file.stat()
    os.utime(module_file, (stat.st_atime, stat.st_mtime + 10))  # a distinct mtime even on coarse clocks
    _fit(model, tmp_path, "edited")
    assert not set(_pids(tmp_path, "edited")) & set(_pids(tmp_path, "before"))
    sys.modules.pop("reuse_edited_module", None)


def test_a_failed_call_stops_the_reused_workers(tmp_path):
    _fit(BoringModel(), tmp_path, "fit")
    with pytest.raises(RayWorkerError) as info:
        _fit(FailingModel(fail_rank=1, how="raise"), tmp_path, "failing")
    assert info.value.rank == 1
    wait_for(lambda: not alive_worker_actors(), 30, "the failed call's workers to be gone")
    # ...and the next call starts new ones.
    _fit(BoringModel(), tmp_path, "after")
    assert not set(_pids(tmp_path, "after")) & set(_pids(tmp_path, "fit"))


def test_horovod_restarts_in_the_reused_workers(tmp_path):
    model = BoringModel()
    _fit(model, tmp_path, "first", strategy=HorovodRayStrategy(num_workers=2))
    after_first = model.layer.weight.clone()
    trainer = _fit(model, tmp_path, "second", strategy=HorovodRayStrategy(num_workers=2))
    assert _pids(tmp_path, "second") == _pids(tmp_path, "first")
    assert not torch.equal(after_first, model.layer.weight)
    assert trainer.current_epoch == 1


def test_workers_waiting_when_ray_shuts_down_are_dropped_without_restarting_ray(tmp_path):
    _fit(BoringModel(), tmp_path, "fit")
    ray.shutdown()
    ray_lightning.release_idle_workers()  # would start a new local Ray if it called into Ray
    assert not ray.is_initialized()
