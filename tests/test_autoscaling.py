"""A cluster whose autoscaler adds the nodes a fit asks for (Ray's fake multi-node provider, real raylets).

Every test runs against autoscaler v1 (``ray up``, ``ray start --autoscaling-config``) and v2
(KubeRay, newer Ray), one cluster each. A cluster starts with its head only (1 CPU, ``shared: 1``).
Each test asks for a custom resource of its own, which only one worker node type (and for
``shared`` the head) has, so that the nodes the autoscaler starts for one test (they stay up a
minute) do not serve another; the tests run in file order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import pytorch_lightning as pl
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from ray_lightning import ClusterResourceError, RayStrategy
from ray_lightning.config.resources import resolve_worker_resources
from ray_lightning.config.variables import SCALE_UP_TIMEOUT_ENV
from ray_lightning.launch import placement, placement_wait
from ray_lightning.launch.autoscaler import Autoscaler, find_autoscaler
from ray_lightning.launch.placement import OwnPlacement
from tests.autoscaling_cluster import AutoscalingCluster
from tests.conftest import ROOT, wait_for
from tests.models import BoringModel

pytestmark = pytest.mark.timeout(900)

NODE_TYPES = {
    "accel_node": {"CPU": 1, "accel": 1},
    "spare_node": {"CPU": 1, "spare": 1},
    "shared_node": {"CPU": 1, "shared": 1},
    "grow_node": {"CPU": 1, "grow": 1},
}
TYPES_TEXT = (
    "accel_node {CPU: 1, accel: 1} (up to 2); spare_node {CPU: 1, spare: 1} (up to 2); "
    "shared_node {CPU: 1, shared: 1} (up to 2); grow_node {CPU: 1, grow: 1} (up to 2); max_workers 8 in all"
)


@pytest.fixture(scope="module", params=["v1", "v2"])
def autoscaling_cluster(request) -> Iterator[AutoscalingCluster]:
    """This process connected to a new autoscaling cluster (the session's local Ray starts again afterwards)."""
    ray.shutdown()
    v2 = request.param == "v2"
    with AutoscalingCluster.start(NODE_TYPES, max_workers=2, head_resources={"shared": 1}, v2=v2) as cluster:
        try:
            ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
            _wait_until_published(cluster)
            yield cluster
        finally:
            ray.shutdown()


def _wait_until_published(cluster: AutoscalingCluster, timeout_s: float = 120) -> None:
    """Until the autoscaler has published what it is and its node types: v1's monitor does so on its
    first update, seconds after the head started (later under load), and until then the cluster looks
    like one without an autoscaler, as it would to a user's driver started that early."""
    try:
        wait_for(
            lambda: (found := find_autoscaler()) is not None and found.node_types is not None,
            timeout_s,
            f"autoscaler {cluster.version}'s monitor to publish its status and node types (find_autoscaler())",
        )
    except AssertionError as error:
        raise AssertionError(f"{error}\n--- monitor.log ---\n{cluster.monitor_log()}") from None


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def driver_log() -> Iterator[list[str]]:
    """What the driver logs: ray_lightning's own loggers and Lightning's (rank_zero_info), which do not propagate."""
    handler = _Lines()
    loggers = [logging.getLogger(name) for name in ("ray_lightning", "pytorch_lightning", "lightning.pytorch")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    yield handler.lines
    for logger, level in zip(loggers, levels):
        logger.removeHandler(handler)
        logger.setLevel(level)


def _nodes_with(resource: str) -> int:
    return sum(1 for n in ray.nodes() if n.get("Alive") and n["Resources"].get(resource))


@pytest.mark.parametrize("where", ["on the driver", "by a task on the head"])
def test_autoscaler_is_found_with_its_node_types(autoscaling_cluster, where, monkeypatch):
    if where != "on the driver":  # a driver elsewhere (its own machine, Ray Client) asks the head
        monkeypatch.setattr("ray_lightning.launch.autoscaler._driver_on_head", lambda: False)
    autoscaler = find_autoscaler()
    assert autoscaler is not None and autoscaler.version == autoscaling_cluster.version
    assert autoscaler.describe_types() == TYPES_TEXT


def test_scale_up_bound_error_says_what_was_asked_and_reported(autoscaling_cluster, driver_log):
    assert _nodes_with("spare") == 0, "this test needs no spare_node up: run the file's tests in order"
    request = resolve_worker_resources(2, 1, False, {"CPU": 1, "spare": 1})
    started = time.monotonic()
    with pytest.raises(ClusterResourceError) as info:
        OwnPlacement.reserve(request, placement_timeout_s=60, scale_up_timeout_s=2)
    elapsed = time.monotonic() - started
    text = str(info.value)
    assert text.startswith("Could not reserve 2 worker(s) x {1 CPU, 1 spare} within 2 s (scale_up_timeout_s)"), text
    assert "The autoscaler reported: " in text and "spare_node {CPU: 1, spare: 1} (up to 2)" in text, text
    assert SCALE_UP_TIMEOUT_ENV in text, text
    assert elapsed < 30, f"the 2 s bound took {elapsed:.1f} s"
    assert any("waiting up to 2 s (scale_up_timeout_s)" in line for line in driver_log), driver_log


def test_what_no_node_type_holds_fails_at_once(autoscaling_cluster):
    strategy = RayStrategy(num_workers=1, resources_per_worker={"CPU": 1, "GPU": 1})
    trainer = pl.Trainer(max_epochs=1, strategy=strategy, logger=False, enable_progress_bar=False)
    started = time.monotonic()
    with pytest.raises(ClusterResourceError) as info:
        trainer.fit(BoringModel())
    elapsed = time.monotonic() - started
    text = str(info.value)
    assert "Neither a node of the Ray cluster nor a node type its autoscaler can launch" in text, text
    assert "Alive nodes: " in text and "{CPU: 1, shared: 1}" in text, text  # the head, at least
    assert f"Node types the autoscaler can launch: {TYPES_TEXT}." in text, text
    assert elapsed < 60, f"an impossible request took {elapsed:.1f} s to fail"


def test_unknown_node_types_wait_for_what_the_autoscaler_says(autoscaling_cluster, driver_log, monkeypatch):
    """Where the node types cannot be read (KubeRay's autoscaler runs in a container of its own), a
    request only the autoscaler might hold is waited for; v2 says at once that no type can hold it."""
    unknown_types = lambda: Autoscaler(autoscaling_cluster.version, None)  # noqa: E731
    monkeypatch.setattr(placement, "find_autoscaler", unknown_types)
    monkeypatch.setattr(placement_wait, "find_autoscaler", unknown_types)
    request = resolve_worker_resources(1, 1, False, {"CPU": 1, "nosuch": 1})
    bound = 120 if autoscaling_cluster.v2 else 6
    started = time.monotonic()
    with pytest.raises(ClusterResourceError) as info:
        OwnPlacement.reserve(request, placement_timeout_s=60, scale_up_timeout_s=bound)
    elapsed = time.monotonic() - started
    if autoscaling_cluster.v2:
        assert str(info.value).startswith("The autoscaler reports that none of its node types can hold"), info.value
        assert elapsed < 60, f"v2's infeasible report took {elapsed:.1f} s to end the wait"
    else:  # v1 does not report placement groups it cannot place
        assert f"within {bound} s (scale_up_timeout_s)" in str(info.value), info.value
    assert any("which no node in the Ray cluster has" in line for line in driver_log), driver_log


def test_busy_nodes_wait_for_the_nodes_the_autoscaler_adds(autoscaling_cluster, driver_log):
    """The alive nodes could hold the request but another job holds them: new nodes would do too."""
    assert _nodes_with("shared") == 1, "this test needs no shared_node up: run the file's tests in order"
    blocker = placement_group([{"CPU": 1, "shared": 1}])  # the head's
    assert blocker.wait(60)
    try:
        request = resolve_worker_resources(1, 1, False, {"shared": 1})
        OwnPlacement.reserve(request, placement_timeout_s=1, scale_up_timeout_s=240).release()
    finally:
        remove_placement_group(blocker)
    assert _nodes_with("shared") == 2
    assert any("waiting up to 240 s (scale_up_timeout_s)" in line for line in driver_log), driver_log


def test_fit_waits_for_the_nodes_the_autoscaler_adds(autoscaling_cluster, driver_log, monkeypatch):
    assert _nodes_with("accel") == 0, "this test needs no accel_node up: run the file's tests in order"
    monkeypatch.setenv(SCALE_UP_TIMEOUT_ENV, "300")  # the default 900 s would hide a hang for 15 minutes
    strategy = RayStrategy(num_workers=2, resources_per_worker={"CPU": 1, "accel": 1})
    trainer = pl.Trainer(max_epochs=1, strategy=strategy, logger=False, enable_progress_bar=False)
    model = BoringModel()
    before = model.layer.weight.detach().clone()
    try:
        trainer.fit(model)
    except ClusterResourceError as error:
        raise AssertionError(f"{error}\n--- monitor.log ---\n{autoscaling_cluster.monitor_log()}") from None
    assert not model.layer.weight.detach().equal(before), "the trained weights did not reach the driver"
    assert _nodes_with("accel") == 2
    assert any("for the autoscaler to add nodes for 2 worker(s) x {1 CPU, 1 accel}" in line for line in driver_log)
    assert any(line.startswith("ray_lightning: reserved 2 worker(s)") for line in driver_log), driver_log


class WaitsForTheSecondNode(BoringModel):
    """On one worker, rank 0 waits at its first batch (bounded) until the autoscaler has added a second grow_node,
    and at epoch 1's first batch until the driver decided to grow (epoch 0's checkpoint is written beside training,
    so epoch 1 could otherwise end before the driver heard of it)."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory

    def training_step(self, batch, batch_idx):
        if self.trainer.world_size == 1 and (self.current_epoch, batch_idx) == (0, 0):
            wait_for(lambda: _nodes_with("grow") == 2, 240, "the autoscaler to add a second grow_node")
        if self.trainer.world_size == 1 and (self.current_epoch, batch_idx) == (1, 0):
            wait_for(lambda: (Path(self.directory) / "grown").exists(), 120, "the driver to grow the fit")
        return super().training_step(batch, batch_idx)


def test_an_elastic_fit_grows_onto_the_node_it_asked_the_autoscaler_for(
    autoscaling_cluster, driver_log, monkeypatch, tmp_path
):
    if autoscaling_cluster.version != "v1":
        pytest.skip("request_resources is one call for both autoscalers: v1's cluster checks it")
    assert _nodes_with("grow") == 0, "this test needs no grow_node up: run the file's tests in order"
    monkeypatch.setenv(SCALE_UP_TIMEOUT_ENV, "300")
    strategy = RayStrategy(num_workers=(1, 2), resources_per_worker={"CPU": 1, "grow": 1}, grow_check_interval_s=0)
    trainer = pl.Trainer(max_epochs=2, strategy=strategy, logger=False, enable_progress_bar=False)
    grown = tmp_path / "grown"
    watch = threading.Thread(target=_touch_when, args=(lambda: trainer.strategy.restarts, grown), daemon=True)
    watch.start()
    try:
        trainer.fit(WaitsForTheSecondNode(str(tmp_path)))
    finally:
        grown.touch()  # ends the watcher whatever happened
    (grow,) = trainer.strategy.restarts
    assert (grow.reason, grow.world_size, grow.epoch) == ("grow", 2, 1), grow
    assert trainer.world_size == 2 and _nodes_with("grow") == 2
    assert any("asked the autoscaler for room for 2 workers" in line for line in driver_log), driver_log


def _touch_when(condition: Callable[[], object], path: Path) -> None:
    """Touch ``path`` once ``condition()`` holds (or someone else touched it); bounded like the model's wait."""
    deadline = time.monotonic() + 600
    while not condition() and not path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    path.touch()
