"""A real Ray cluster on this machine, started and stopped with the `ray` CLI the way a user does it.

    with CliCluster.start(head_resources={"head_node": 1}, client_server=True) as cluster:
        cluster.add_node(num_cpus=1, resources={"worker_node": 1})
        cluster.wait_for_nodes(2)
        cluster.ray("job", "submit", "--address", cluster.dashboard_url, "--", "python", "x.py")

Every node is a ``ray start ... --block`` process in a session of its own, bound to 127.0.0.1 on
ports chosen here, with a short ``--temp-dir`` of its own (Unix socket paths must stay under 107
bytes). Stopping sends SIGTERM to those processes (with ``--block``, ``ray start`` then stops its
node's Ray processes) and finally kills whatever is left in their sessions. ``ray stop`` is never
used: it stops every Ray on the machine, including other test sessions' and this process's own.

Every node and CLI call runs with the same RAY_AUTH_MODE (see :func:`auth_mode`). The state of
the cluster (nodes, jobs) is read through the dashboard's HTTP API, with Ray's auth token when
that mode is "token", so this module needs no Ray connection of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import wait_for

# The venv's `ray` CLI, next to the interpreter that runs the tests.
RAY_CLI = str(Path(sys.executable).parent / "ray")
HOST = "127.0.0.1"


def free_port() -> int:
    """A port nothing listens on now (the OS picks it; another process could still take it before Ray does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _token() -> str | None:
    """Ray's auth token, from where Ray itself looks: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    return path.read_text().strip() if path.is_file() else None


def auth_mode() -> str:
    """The RAY_AUTH_MODE every process of the cluster gets.

    A head started by ``ray start`` turns token authentication on by itself when a token exists
    (Ray writes ~/.ray/auth_token on the first local ``ray.init``), but ``ray start --address``
    on a worker node and the CLI's HTTP client (``ray job submit``) only use the token when
    RAY_AUTH_MODE=token is set, so a user's cluster needs it set on every node; so does this one.
    """
    explicit = os.environ.get("RAY_AUTH_MODE")
    if explicit:
        return explicit
    return "token" if _token() else "disabled"


@dataclass
class _Node:
    label: str  # also the node's name in Ray (`ray start --node-name`)
    process: subprocess.Popen
    temp_dir: Path
    log: Path
    start: tuple[list[str], int, dict[str, float] | None]  # what `ray start` was given: args, CPUs, resources
    started_again: bool = False


# What `ray start` prints when its raylet did not register with the GCS within Ray's fixed 30 s (ray/_private/node.py;
# no setting changes it). On 2 busy cores a worker node joining a head did miss it (a full suite run, 2026-11-30).
STARTUP_TIMED_OUT = "The current node timed out during startup"


@dataclass
class CliCluster:
    """A head node (GCS, dashboard, Jobs, optionally the Ray Client server) and worker nodes, all on loopback."""

    temp_dir: Path
    gcs_port: int
    dashboard_port: int
    client_port: int | None
    env: dict[str, str]
    nodes: list[_Node] = field(default_factory=list)

    @property
    def address(self) -> str:
        """What ``ray start --address`` and ``RAY_ADDRESS`` take."""
        return f"{HOST}:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        """What ``ray job submit --address`` takes."""
        return f"http://{HOST}:{self.dashboard_port}"

    @property
    def client_address(self) -> str:
        """What ``ray.init`` takes to connect through Ray Client."""
        if self.client_port is None:
            raise ValueError("this cluster was started without a Ray Client server (client_server=False)")
        return f"ray://{HOST}:{self.client_port}"

    @classmethod
    @contextlib.contextmanager
    def start(
        cls,
        num_cpus: int = 1,
        head_resources: dict[str, float] | None = None,
        client_server: bool = False,
        timeout_s: float = 120,
    ) -> Iterator[CliCluster]:
        """Start the head node; the cluster is stopped when the block exits, whatever happened in it."""
        # Short on purpose: Ray puts Unix sockets under <temp dir>/session_.../sockets/.
        temp_dir = Path(tempfile.mkdtemp(prefix="rl-", dir="/tmp"))
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_JOB_CONFIG_JSON_ENV_VAR")}
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        env["RAY_AUTH_MODE"] = auth_mode()
        # As in an activated venv on every node: a job's `python` is this interpreter.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        cluster = cls(
            temp_dir=temp_dir,
            gcs_port=free_port(),
            dashboard_port=free_port(),
            client_port=free_port() if client_server else None,
            env=env,
        )
        try:
            args = [
                "--head",
                f"--port={cluster.gcs_port}",
                "--include-dashboard=true",
                f"--dashboard-host={HOST}",
                f"--dashboard-port={cluster.dashboard_port}",
            ]
            if cluster.client_port is not None:
                args.append(f"--ray-client-server-port={cluster.client_port}")
            cluster._start_node("head", args, num_cpus, head_resources)
            cluster.wait_for_nodes(1, timeout_s)
            yield cluster
        finally:
            cluster.stop()

    def add_node(self, num_cpus: int = 1, resources: dict[str, float] | None = None) -> None:
        """Start a worker node that joins the head, as ``ray start --address HEAD:PORT`` on another machine would."""
        self._start_node(f"worker{len(self.nodes)}", [f"--address={self.address}"], num_cpus, resources)

    def node_ids(self) -> dict[str, str]:
        """Ray's node id of each alive node, by label ("head", "worker1", ...)."""
        return {n["node_name"]: n["node_id"] for n in self.alive_nodes()}

    def node_temp_dir(self, label: str) -> Path:
        """The ``--temp-dir`` of a node: what Ray ships to that node is unpacked under it."""
        return next(n.temp_dir for n in self.nodes if n.label == label)

    def log_tails(self, pattern: str, chars: int = 3000) -> str:
        """The ends of the Ray log files named ``pattern`` (e.g. ``ray_client_server*.err``) on every node.

        For failure messages: the cluster's temp dir, logs included, is removed when it stops.
        """
        parts = []
        for node in self.nodes:
            for path in sorted(node.temp_dir.glob(f"session_*/logs/{pattern}")):
                text = path.read_text(errors="replace")[-chars:]
                parts.append(f"--- {node.label}: {path.name} ---\n{text}")
        return "\n".join(parts) or f"(no log files named {pattern})"

    def _start_node(self, label: str, args: list[str], num_cpus: int, resources: dict[str, float] | None) -> None:
        # Each node has a temp dir of its own, as on separate machines: what Ray ships to a node
        # (a job's working_dir, py_modules) is unpacked there, visibly apart from the head's copy.
        node_dir = self.temp_dir / label
        node_dir.mkdir(parents=True, exist_ok=True)
        log = self.temp_dir / f"{label}.log"
        self.nodes.append(_Node(label, self._spawn(label, args, num_cpus, resources, node_dir, log), node_dir, log,
                                (args, num_cpus, resources)))  # fmt: skip

    def _start_again(self, node: _Node) -> None:
        """Start a node whose ``ray start`` gave up waiting for its raylet to register (:data:`STARTUP_TIMED_OUT`),
        once, after stopping what its first start left (a raylet that registers late would be a node too many)."""
        # start_new_session: the pid is the session's id
        end_sessions({node.process.pid}, 30, f"the {node.label} node's first start to exit")
        node.process = self._spawn(node.label, *node.start, node.temp_dir, node.log)
        node.started_again = True

    def _spawn(
        self,
        label: str,
        args: list[str],
        num_cpus: int,
        resources: dict[str, float] | None,
        node_dir: Path,
        log: Path,
    ) -> subprocess.Popen:
        # Ports with a fixed default (the dashboard agent's 52365, ...) are chosen here, so that
        # several nodes and other clusters on this machine do not collide.
        command = [
            RAY_CLI,
            "start",
            *args,
            f"--node-ip-address={HOST}",
            f"--node-name={label}",
            f"--num-cpus={num_cpus}",
            f"--resources={json.dumps(resources or {})}",
            f"--temp-dir={node_dir}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            "--disable-usage-stats",
            "--block",
        ]
        with open(log, "ab") as out:
            # The node's processes, and so its Ray workers, start in this directory (not the
            # tests' checkout): a relative path a worker writes to lands there.
            return subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=node_dir, start_new_session=True
            )

    def ray(self, *args: str, timeout_s: float = 180, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        """Run the ``ray`` CLI against this cluster's environment; returns its exit code and output."""
        return subprocess.run(
            [RAY_CLI, *args],
            env=self.env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def api(self, path: str) -> dict:
        """GET a dashboard endpoint (``/api/v0/nodes``, ``/api/jobs/``...) and decode its JSON."""
        token = _token() if self.env["RAY_AUTH_MODE"] == "token" else None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(self.dashboard_url + path, headers=headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.load(response)

    def alive_nodes(self) -> list[dict]:
        """The ALIVE nodes as the state API lists them (node_id, node_ip, resources_total, ...)."""
        nodes = self.api("/api/v0/nodes?limit=100&detail=true")["data"]["result"]["result"]
        return [n for n in nodes if n["state"] == "ALIVE"]

    def wait_for_nodes(self, count: int, timeout_s: float = 120) -> None:
        """Wait until ``count`` nodes are alive (the dashboard answers once the head is up)."""

        def enough() -> bool:
            for node in self.nodes:
                if node.process.poll() is not None:
                    if not node.started_again and STARTUP_TIMED_OUT in node.log.read_text(errors="replace"):
                        self._start_again(node)
                        continue
                    raise RuntimeError(
                        f"`ray start` for the {node.label} node exited with {node.process.returncode}:\n"
                        + node.log.read_text(errors="replace")[-4000:]
                    )
            try:
                return len(self.alive_nodes()) >= count
            except (urllib.error.URLError, OSError, KeyError, ValueError):
                return False

        wait_for(enough, timeout_s, f"{count} alive Ray node(s) at {self.dashboard_url}")

    def stop(self, timeout_s: float = 60) -> None:
        """Stop this cluster's nodes, workers before the head, and only them; remove the temp dir."""
        sessions = {node.process.pid for node in self.nodes}  # start_new_session: pid == session id
        for node in reversed(self.nodes):
            if node.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    node.process.send_signal(signal.SIGTERM)
            try:
                node.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait(timeout=10)
        # `ray start` stops the processes it started; anything left behind (a worker process
        # between tasks, a slow agent) is still in one of these sessions.
        with contextlib.suppress(AssertionError):  # a test that needs them gone asserts it itself
            end_sessions(sessions, 10, "the cluster's processes to exit")
        self.nodes = []
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def end_sessions(sessions: set[int], timeout_s: float, what: str) -> None:
    """SIGKILL every process left in ``sessions`` and wait (``timeout_s``, failing with ``what``) until none is."""
    for pid in processes_in_sessions(sessions):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not processes_in_sessions(sessions), timeout_s, what)


def processes_in_sessions(sessions: set[int]) -> list[int]:
    """Pids of live (not zombie) processes whose session id is in ``sessions`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp session ...
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[3]) in sessions:
            found.append(int(entry.name))
    return found
