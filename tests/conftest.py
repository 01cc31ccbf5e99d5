"""Shared fixtures: one local Ray for the whole session, started once (slow on 2 cores).

Ray is imported where a fixture needs it, not here: the modules that start no Ray (tests/test_dev_gpu.py)
also run where Ray is missing, as on a GPU image before its pack is unpacked.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.s3_server import bucket, s3_endpoint  # noqa: F401 - fixtures of the storage tests (moto is imported lazily)

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

# Every Ray the tests start (the session's, clusters', examples', benchmarks') inherits this. Nothing here reads Ray's
# Prometheus metrics; collecting them cost an idle Ray a quarter of its CPU (4.9 against 3.7 CPU-seconds a minute,
# measured), in each of the suite's Rays for all its minutes.
os.environ.setdefault("RAY_enable_metrics_collection", "0")
# More logical CPUs than this machine has: the tests start several 1-CPU workers at once.
SESSION_CPUS = 8
SESSION_RESOURCES = {"custom_accel": 4}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def ray_local():
    """The local Ray shared by the tests: started on first use, re-started after a multi-node test."""
    import ray

    if not ray.is_initialized() or "custom_accel" not in ray.cluster_resources():
        ray.shutdown()
        # Tune's trial processes import the tests' modules by name, as a user's would import theirs. The path goes
        # to Ray's own processes through the environment they inherit, not a job runtime_env: with one, Ray starts
        # every worker through setup_worker.py (a second interpreter importing Ray), which doubled an actor's
        # start (3 pairs of actors: 4.9 s against 2.6 s, measured on 2 cores).
        os.environ["PYTHONPATH"] = session_pythonpath()
        # address="local": a new Ray of our own, even when another one runs on this machine.
        ray.init(address="local", num_cpus=SESSION_CPUS, resources=SESSION_RESOURCES, include_dashboard=True)
    yield ray


def session_pythonpath() -> str:
    """The checkout, then this process's own ``PYTHONPATH``: Ray's ``env_vars`` replace a variable, and where Ray
    itself comes from ``PYTHONPATH`` (a GPU image with the pack of ``dev.py gpu``) its workers need it too."""
    entries = [str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(p for p in entries if p))  # once each: ray_local sets it in os.environ


@contextlib.contextmanager
def connected_cluster(
    *worker_nodes: dict, runtime_env: dict | None = None, head_resources: dict | None = None
) -> Iterator[Cluster]:
    """This process connected to a new ``ray.cluster_utils.Cluster``: a 1-CPU head (the driver's node, with
    ``head_resources``) and one node per ``add_node`` keyword dict; shut down afterwards (the session's local Ray
    starts again on the next ``ray_local``). ``runtime_env``: the job's, as a user gives one to ship code."""
    import ray
    from ray.cluster_utils import Cluster

    _stop_waiting_workers()
    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": head_resources or {}})
    for node in worker_nodes:
        cluster.add_node(**node)
    try:
        ray.init(address=cluster.address, runtime_env=runtime_env)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait for a condition with a bound; the failure names what was awaited."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


def wait_for_no_placement_groups(timeout_s: float, what: str) -> None:
    """Wait until this process's Ray holds no placement group; the failure lists those left.

    Why groups and not ``ray.available_resources()``: Ray's raylet was seen keeping 3 CPUs "used" with no placement
    group, actor or task left (one of two full suite runs, after Tune removed trial groups with workers in them), so
    a free-CPU count tests Ray's accounting; a group left behind is what this package or Tune would leak.
    """
    try:
        wait_for(lambda: not live_placement_groups(), timeout_s, what)
    except AssertionError as error:
        raise AssertionError(f"{error}; left: {live_placement_groups()}") from None


def live_placement_groups() -> list:
    """This process's Ray's placement groups not removed: (name, state, bundles)."""
    import ray
    from ray.util.state import list_placement_groups

    address = ray.get_runtime_context().gcs_address
    groups = list_placement_groups(address=address, detail=True, filters=[("state", "!=", "REMOVED")])
    return [(g.name, g.state, [b["unit_resources"] for b in g.bundles]) for g in groups]


def alive_worker_actors() -> list:
    import ray
    from ray.util.state import list_actors

    # This process's Ray, also when other Ray instances run on the machine.
    address = ray.get_runtime_context().gcs_address
    return [a for a in list_actors(address=address, filters=[("state", "=", "ALIVE")]) if a.class_name == "RayWorker"]


@pytest.fixture(autouse=True)
def _isolate_cwd(tmp_path, monkeypatch):
    # Lightning writes lightning_logs/ and checkpoints/ under the working directory.
    monkeypatch.chdir(tmp_path)


def _stop_waiting_workers() -> None:
    # Workers wait only after a call of ray_lightning in this process: where it was never imported, none do.
    ray_lightning = sys.modules.get("ray_lightning")
    if ray_lightning is not None:
        ray_lightning.release_idle_workers()


@pytest.fixture(autouse=True, scope="module")
def _share_waiting_workers_within_the_module():
    """Workers a fit leaves waiting (``keep_workers_alive_s``) serve the module's next fit with the same
    worker shape, as they serve a user's next fit: starting workers (new processes importing torch and
    Lightning) is most of a small fit's time. Each module starts and ends without waiting workers."""
    _stop_waiting_workers()
    yield
    _stop_waiting_workers()


@pytest.fixture
def no_waiting_workers():
    """For a test that needs the cluster to itself: it counts worker actors or free CPUs, or runs Tune
    trials or raw Ray actors on all the CPUs. Stops the workers an earlier test of the module left
    waiting, and waits until their actors are gone."""
    import ray

    _stop_waiting_workers()
    if ray.is_initialized():
        wait_for(lambda: not alive_worker_actors(), 30, "the workers earlier tests left waiting to stop")
    yield


# `python3 dev.py test --fast` (pytest -m fast): the tier for an edit loop, a few minutes. Every test that starts
# no Ray, no cluster and no other Python, and these single fits, which together cross every layer once.
FAST_FITS = {
    "tests/test_training.py::test_fit_brings_trained_weights_and_state_back[2]",
    "tests/test_training.py::test_best_checkpoint_loads_on_driver",
    "tests/test_docs.py::test_the_pages_python_runs[docs/getting-started.md]",
}
# What in a test's own code starts processes: clusters of several nodes, scripts, kernels, venvs.
STARTS_PROCESSES = ("ray_local", "ray.init", "connected_cluster", "Cluster(", "subprocess", "sys.executable", "gloo")
# Modules whose tests start scripts, kernels or venvs through helpers of their own.
SLOW_MODULES = {
    "test_cli",
    "test_cluster_cli",
    "test_dev_gpu",
    "test_docs",
    "test_hydra_app",
    "test_lint",
    "test_namespaces",
    "test_notebook",
    "test_stacks",
}


def _starts_processes(item) -> bool:
    """Whether the test's own code or one of its fixtures' starts Ray, a cluster or another Python."""
    import inspect

    functions = [item.function]
    for definitions in item._fixtureinfo.name2fixturedefs.values():
        functions += [definition.func for definition in definitions if definition.baseid]  # ours, not pytest's
    try:
        sources = [inspect.getsource(f) for f in functions]
    except (OSError, TypeError):
        return True
    return any(mark in source for source in sources for mark in STARTS_PROCESSES)


# The test files of a minute or more, slowest first (their summed test times in a full run of `dev.py test` on a
# 2-core machine, 2026-11-28): the suite's two processes (dev.py SUITE_PROCESSES) take files in this order, then the
# rest in file order, so no long file starts last while the other process sits idle. Only the order depends on it.
SLOWEST_FIRST = (
    "tests/test_data.py",
    "tests/test_tune.py",
    "tests/test_fabric.py",
    "tests/test_benchmarks_recovery.py",
    "tests/test_training.py",
    "tests/test_benchmarks_elastic.py",
    "tests/test_cluster_cli.py",
    "tests/test_restarts_multinode.py",
    "tests/test_tune_scale.py",
    "tests/test_autoscaling.py",
    "tests/test_hangs.py",
    "tests/test_docs.py",
    "tests/test_cli.py",
    "tests/test_horovod.py",
    "tests/test_restarts.py",
    "tests/test_benchmarks.py",
    "tests/test_benchmarks_storage.py",
    "tests/test_storage.py",
    "tests/test_multinode.py",
    "tests/test_benchmarks_data.py",
    "tests/test_benchmarks_elastic_join.py",
    "tests/test_loggers.py",
    "tests/test_notebook.py",
    "tests/test_hydra_app.py",
    "tests/test_deepspeed.py",
    "tests/test_namespaces.py",
    "tests/test_elastic.py",
    "tests/test_benchmarks_sharded.py",
    "tests/test_benchmarks_tune.py",
    "tests/test_sharded_multinode.py",
    "tests/test_benchmarks_step.py",
    "tests/test_worker_reuse.py",
    "tests/test_benchmarks_fabric.py",
)


def _slowest_first(items: list) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: file order otherwise


def pytest_collection_modifyitems(config, items):
    _slowest_first(items)
    if "fast" not in (config.getoption("markexpr") or ""):
        return
    for item in items:
        module = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
        unit = module not in SLOW_MODULES and not module.startswith("test_benchmark") and not _starts_processes(item)
        if item.nodeid in FAST_FITS or unit:
            item.add_marker(pytest.mark.fast)
