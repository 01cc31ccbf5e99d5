"""Shared fixtures: one local Ray for the whole session, started once (slow on 2 cores)."""

from __future__ import annotations

import time
from typing import Callable

import pytest
import ray

# More logical CPUs than this machine has: the tests start several 1-CPU workers at once.
SESSION_CPUS = 8
SESSION_RESOURCES = {"custom_accel": 4}


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray cluster shared by every test that uses it."""
    if not ray.is_initialized():
        ray.init(num_cpus=SESSION_CPUS, resources=SESSION_RESOURCES, include_dashboard=True, log_to_driver=True)
    yield ray
    # Left running for other tests; pytest's exit tears the local cluster down.


@pytest.fixture
def ray_local(ray_session):
    """The shared local Ray; re-started if a multi-node test replaced it."""
    if ray.get_runtime_context().gcs_address and "custom_accel" not in ray.cluster_resources():
        ray.shutdown()
        ray.init(num_cpus=SESSION_CPUS, resources=SESSION_RESOURCES, include_dashboard=True)
    yield ray


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait for a condition with a bound; the failure names what was awaited."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


def alive_worker_actors() -> list:
    from ray.util.state import list_actors

    return [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if a.class_name == "RayWorker"]


@pytest.fixture(autouse=True)
def _isolate_cwd(tmp_path, monkeypatch):
    # Lightning writes lightning_logs/ and checkpoints/ under the working directory.
    monkeypatch.chdir(tmp_path)
