"""A local autoscaling Ray cluster: a head whose autoscaler (v1 or v2) starts real nodes on this machine.

    with AutoscalingCluster.start({"accel_node": {"CPU": 1, "accel": 1}}, max_workers=2) as cluster:
        ray.init(address=cluster.address)

The cluster runs with this process's RAY_AUTH_MODE, else "disabled": a driver connecting by
address reads that variable once, when Ray is imported, and cannot switch to a token afterwards.

Ray's fake multi-node provider (``RAY_FAKE_CLUSTER=1``, provider ``fake_multinode``) runs the real
autoscaler in the head's monitor process; a node it "launches" is a raylet started on this machine
(a child of the monitor), so pending demand brings nodes up as on a cloud, in seconds.
``ray.cluster_utils.AutoscalingCluster`` is not used: it runs ``ray stop --force`` (every Ray on
the machine) and reads an ``example.yaml`` the wheel does not ship.

Stopping takes a snapshot of the head's whole process tree first (the fake nodes hang off the
monitor and are orphaned when it exits), SIGTERMs the head, then whatever of the snapshot is
left, then SIGKILLs. ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0`` keeps a node with live actors
from waiting 30 s to drain itself before it exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import ray

from tests.cli_cluster import HOST, RAY_CLI, free_port, processes_in_sessions
from tests.conftest import wait_for

HEAD_TYPE = "ray.head.default"  # the name the fake provider gives the head's type
HEAD_NODE_ID = "f" * 51 + "00000"  # the id the fake provider gives the head
# Autoscaler v2 fills in defaults from the provider type's example.yaml, which the wheel does not
# ship for fake_multinode: the same provider named as an external module has none.
_V2_PROVIDER = {
    "type": "external",
    "module": "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider",
    "launch_multiple": True,
    "head_node_id": HEAD_NODE_ID,
}
_V2_ENV = {"RAY_enable_autoscaler_v2": "1", "RAY_CLOUD_INSTANCE_ID": HEAD_NODE_ID}


def cluster_config(
    port: int,
    node_types: dict[str, dict[str, float]],
    max_workers: int,
    head_resources: dict[str, float],
    v2: bool = False,
) -> dict:
    """The autoscaling config: every key the v1 autoscaler reads (a missing one crashes its threads)."""
    head = {"resources": {"CPU": 1, **head_resources}, "node_config": {}, "max_workers": 0}
    types: dict[str, dict] = {HEAD_TYPE: head}
    for name, resources in node_types.items():
        # A fake node's object store is sized by its resources, else it asks for a large default.
        sized = {"object_store_memory": 100_000_000, **resources}
        types[name] = {"resources": sized, "node_config": {}, "min_workers": 0, "max_workers": max_workers}
    return {
        "cluster_name": f"fake-{port}",
        "max_workers": max_workers * len(node_types),
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": f"{HOST}:{port}",  # else new nodes look for port 6379
            **(_V2_PROVIDER if v2 else {}),
        },
        "available_node_types": types,
        "head_node_type": HEAD_TYPE,
        "auth": {},
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 1.0,
        "docker": {},
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


@dataclass
class AutoscalingCluster:
    """The head's ``ray start --block`` process, its config and temp dir."""

    temp_dir: Path
    port: int
    process: subprocess.Popen
    env: dict[str, str]
    log: Path
    v2: bool = False

    @property
    def version(self) -> str:
        return "v2" if self.v2 else "v1"

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @classmethod
    @contextlib.contextmanager
    def start(
        cls,
        node_types: dict[str, dict[str, float]],
        max_workers: int = 2,
        head_resources: dict[str, float] | None = None,
        v2: bool = False,
        timeout_s: float = 120,
    ) -> Iterator[AutoscalingCluster]:
        """Start the head (1 CPU and ``head_resources``) with an autoscaler (v1, or ``v2``) that may add
        ``max_workers`` nodes of each type in ``node_types`` (name: resources).

        Started again on new ports (up to 3 times) when `ray start` fails to start: free_port() only says a port
        was free, and another process (the suite's other pytest process, dev.py runs two) may bind it first."""
        for attempt in (1, 2, 3):
            cluster = cls._launch(node_types, max_workers, head_resources, v2)
            try:
                wait_for(cluster._started, timeout_s, f"the autoscaling head at {cluster.address} to start")
                break
            except BaseException as error:
                cluster.stop()
                if attempt == 3 or "Failed to start" not in str(error):
                    raise
        try:
            yield cluster
        finally:
            cluster.stop()

    @classmethod
    def _launch(
        cls,
        node_types: dict[str, dict[str, float]],
        max_workers: int,
        head_resources: dict[str, float] | None,
        v2: bool,
    ) -> AutoscalingCluster:
        """`ray start --head` on ports free now, not yet waited for."""
        # Short on purpose: Ray puts Unix sockets under <temp dir>/session_.../sockets/.
        temp_dir = Path(tempfile.mkdtemp(prefix="ras-", dir="/tmp"))
        port = free_port()
        config = temp_dir / "autoscaling.json"
        head_resources = head_resources or {}
        config.write_text(json.dumps(cluster_config(port, node_types, max_workers, head_resources, v2), indent=1))
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_JOB_CONFIG_JSON_ENV_VAR")}
        env.update(
            RAY_FAKE_CLUSTER="1",
            AUTOSCALER_UPDATE_INTERVAL_S="1",
            AUTOSCALER_METRIC_PORT=str(free_port()),
            RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
            RAY_USAGE_STATS_ENABLED="0",
            RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"),
            **({**_V2_ENV, "RAY_OVERRIDE_NODE_ID_FOR_TESTING": HEAD_NODE_ID} if v2 else {}),
        )
        command = [
            RAY_CLI,
            "start",
            "--head",
            f"--port={port}",
            f"--node-ip-address={HOST}",
            f"--autoscaling-config={config}",
            "--num-cpus=1",
            f"--resources={json.dumps(head_resources)}",
            f"--temp-dir={temp_dir / 'ray'}",
            f"--dashboard-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            "--disable-usage-stats",
            "--block",
        ]
        log = temp_dir / "head.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=temp_dir, start_new_session=True
            )
        return cls(temp_dir, port, process, env, log, v2)

    def _started(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"`ray start --head` exited with {self.process.returncode}:\n{self.log_tail()}")
        return "Ray runtime started" in self.log.read_text(errors="replace")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def monitor_log(self, chars: int = 6000) -> str:
        """The end of the autoscaler's log (what it launched, and why not), for failure messages."""
        logs = sorted(self.temp_dir.glob("ray/session_*/logs/monitor.log"))
        return logs[-1].read_text(errors="replace")[-chars:] if logs else "(no monitor.log)"

    def stop(self, grace_s: float = 15.0) -> float:
        """Stop the head and every node its autoscaler started, by pid; return the seconds it took."""
        started = time.monotonic()
        # A driver still connected would be ended by Ray itself (its object store gone) halfway through.
        if ray.is_initialized() and ray.get_runtime_context().gcs_address.endswith(f":{self.port}"):
            ray.shutdown()
        try:
            root = psutil.Process(self.process.pid)
            tree = [root, *root.children(recursive=True)]  # before signalling: the fake nodes get orphaned
        except psutil.NoSuchProcess:
            tree = []
        if self.process.poll() is None:
            self.process.terminate()  # `ray start --block` stops its own node's processes
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=grace_s)
        # The fake nodes' raylets and agents outlive the head, and a raylet whose GCS is gone may
        # not finish its own shutdown: a short grace, then SIGKILL.
        rest = [p for p in tree if _running(p)]
        for process in rest:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.terminate()
        _, alive = psutil.wait_procs(rest, timeout=min(grace_s, 5.0))
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        # Worker processes started after the snapshot, still in the head's session.
        for pid in processes_in_sessions({self.process.pid}):
            with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return time.monotonic() - started


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
