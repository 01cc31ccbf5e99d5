"""From laptop to cluster: the cluster config, jobs on a cluster started with `ray start`, and Ray Client.

The clusters here are real multi-node Ray clusters on this machine, started with the `ray` CLI as a
user would (tests/cli_cluster.py); each node has its own temp dir, so what Ray ships to a node is
visibly that node's copy.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
import yaml

from tests.cli_cluster import STARTUP_TIMED_OUT, CliCluster, processes_in_sessions

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "examples" / "cluster.yaml"
JOB_DIR = ROOT / "examples" / "cluster_job"


# -- examples/cluster.yaml -------------------------------------------------------------------------


def test_cluster_yaml_passes_ray_ups_own_checks():
    """What `ray up` does with the file before it contacts the cloud: fill in defaults, then validate."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(CLUSTER_YAML.read_text())
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)

    node_types = prepared["available_node_types"]
    workers = [t for name, t in node_types.items() if name != prepared["head_node_type"]]
    assert any(t["resources"].get("GPU", 0) >= 1 for t in workers), "no GPU worker node type"
    assert node_types[prepared["head_node_type"]]["resources"].get("CPU") == 0, "the head should hold no workers"
    # `ray up` runs from the checkout's root: every local path it syncs must exist there, as a
    # directory (Docker bind-mounts file_mounts; a mounted single file goes stale).
    for remote, local in prepared["file_mounts"].items():
        assert (ROOT / local).is_dir(), f"file_mounts[{remote!r}] = {local!r} is not a directory of the checkout"
    # The container's PYTHONPATH points into those mounts ("~" is /home/ray in the image).
    targets = {remote.replace("~", "/home/ray", 1) for remote in prepared["file_mounts"]}
    (pythonpath,) = [o.split("=", 1)[1] for o in prepared["docker"]["run_options"] if "PYTHONPATH=" in o]
    for entry in pythonpath.split(":"):
        assert any(t == entry or t.startswith(entry + "/") for t in targets), f"{entry} is not mounted"
    assert (JOB_DIR / "digits_model.py").is_file() and (ROOT / "ray_lightning" / "__init__.py").is_file()


# -- jobs on a two-node cluster --------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_node_cluster():
    """A head and a worker node with one CPU each: a fit with two 1-CPU workers must use both."""
    with CliCluster.start(num_cpus=1, head_resources={"head_node": 1}) as cluster:
        cluster.add_node(num_cpus=1, resources={"worker_node": 1})
        cluster.wait_for_nodes(2)
        yield cluster


@dataclass
class TrainOutput:
    """What examples/cluster_job/train.py printed."""

    text: str
    placements: dict[int, tuple[str, str]]  # rank -> (node id, file digits_model was imported from)
    val_acc: float
    best_checkpoint: Path

    @classmethod
    def parse(cls, text: str) -> TrainOutput:
        placements = {
            int(rank): (node, module)
            for rank, node, module in re.findall(r"^\s*rank (\d+): node (\w+) .*digits_model from (\S+)$", text, re.M)
        }
        val_acc = re.search(r"^\s*val_acc = ([0-9.]+)$", text, re.M)
        best = re.search(r"^Best checkpoint on this machine: (.+)$", text, re.M)
        assert placements and val_acc and best, f"train.py did not print its results:\n{text[-6000:]}"
        return cls(text, placements, float(val_acc.group(1)), Path(best.group(1).strip()))

    def check(self, cluster: CliCluster, output_dir: Path, shipped_as: str) -> None:
        """Both nodes trained, each from its own shipped copy of digits_model; results are here."""
        # The launcher's own line (rank_zero_info on the driver).
        assert "2 worker(s)" in self.text and "on 2 node(s)" in self.text, self.text[-6000:]
        node_ids = cluster.node_ids()
        assert sorted(self.placements) == [0, 1]
        assert {node for node, _ in self.placements.values()} == set(node_ids.values())
        for label, node_id in node_ids.items():
            (module,) = [m for node, m in self.placements.values() if node == node_id]
            # Unpacked by Ray on that node from what the driver or the job shipped.
            expected = cluster.node_temp_dir(label)
            assert Path(module).is_relative_to(expected) and f"runtime_resources/{shipped_as}" in module, (
                f"rank on {label} imported digits_model from {module}, not from {shipped_as} under {expected}"
            )
        assert 0.0 <= self.val_acc <= 1.0
        assert self.best_checkpoint.is_file() and self.best_checkpoint.is_relative_to(output_dir)
        assert "reloaded with channels=16" in self.text


@pytest.mark.timeout(300)
def test_ray_job_submit_trains_on_both_nodes(two_node_cluster, tmp_path):
    """`ray job submit --working-dir examples/cluster_job -- python train.py`, as in the README."""
    cluster = two_node_cluster
    output_dir = tmp_path / "runs"
    result = cluster.ray(
        "job",
        "submit",
        f"--address={cluster.dashboard_url}",
        f"--working-dir={JOB_DIR}",
        "--",
        *("python", "train.py", "--num-workers", "2", "--max-epochs", "1", "--output-dir", str(output_dir)),
        timeout_s=270,
    )
    text = result.stdout + result.stderr
    assert result.returncode == 0, f"`ray job submit` exited with {result.returncode}:\n{text[-8000:]}"
    assert re.search(r"Job 'raysubmit_\w+' succeeded", text), text[-4000:]
    TrainOutput.parse(text).check(cluster, output_dir, shipped_as="working_dir_files")


@pytest.mark.timeout(300)
def test_script_run_like_ray_submit_ships_its_module(two_node_cluster, tmp_path):
    """`ray submit` runs ~/train.py on the head as a plain driver: the script ships digits_model itself."""
    home = tmp_path / "home"  # the head's home directory: train.py, and digits_model.py from file_mounts
    home.mkdir()
    for name in ("train.py", "digits_model.py"):
        shutil.copy(JOB_DIR / name, home / name)
    output_dir = tmp_path / "runs"
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "as_ray_submit.py"), str(home / "train.py")]
        + ["--num-workers", "2", "--max-epochs", "1", "--output-dir", str(output_dir)],
        cwd=tmp_path,
        # On a head node, ray.init() finds the local cluster by itself; this one is found by address.
        env={**two_node_cluster.env, "RAY_ADDRESS": two_node_cluster.address},
        capture_output=True,
        text=True,
        timeout=270,
    )
    text = result.stdout + result.stderr
    assert result.returncode == 0, f"the driver exited with {result.returncode}:\n{text[-8000:]}"
    assert not home.exists(), "as_ray_submit.py should have removed the script's directory"
    TrainOutput.parse(text).check(two_node_cluster, output_dir, shipped_as="py_modules_files")


# -- Ray Client ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client_cluster():
    """A head with the Ray Client server and a worker node, 2 CPUs each; ``{"X_slot": 1}`` picks a node.

    A client's driver lives on the head, in the client server's process: Ray sees the head as the
    driver's node, wherever the client runs.
    """
    with CliCluster.start(num_cpus=2, head_resources={"head_slot": 2}, client_server=True) as cluster:
        cluster.add_node(num_cpus=2, resources={"worker_slot": 2})
        cluster.wait_for_nodes(2)
        yield cluster


# The three Ray Client fits the tests below check: (workers' node, loggers' save_dir relative).
CLIENT_RUNS = {"absolute": ("worker", False), "relative": ("worker", True), "head": ("head", True)}


@pytest.fixture(scope="module")
def client_reports(client_cluster, tmp_path_factory) -> dict[str, tuple[dict, Path, str]]:
    """tests/ray_client_driver.py in a process of its own (this one has its own Ray), connected once for
    the fits of CLIENT_RUNS, one after another as in a user's session, each from a working directory of
    its own; per run, its summary, that directory and the end of the driver's and the client server's logs.

    Workers on ``node`` ("head" or "worker"); with ``relative`` the loggers' save_dir is relative, so
    rank 0 writes under its own node's working directory instead of the driver's, as it would on
    another machine.
    """
    base = tmp_path_factory.mktemp("client")
    runs = []
    for name, (node, relative) in CLIENT_RUNS.items():
        (base / name).mkdir()
        resources = {"CPU": 1, f"{node}_slot": 1}
        runs.append({"workdir": str(base / name), "summary": str(base / f"{name}.json"), "resources": resources,
                     "relative": relative})  # fmt: skip
    (base / "runs.json").write_text(json.dumps(runs))
    for attempt in (1, 2):
        result = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "ray_client_driver.py"), client_cluster.client_address,
             str(base / "runs.json")],
            cwd=base,
            env={**client_cluster.env, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=500,
        )  # fmt: skip
        output = result.stdout + result.stderr
        server_logs = client_cluster.log_tails("ray_client_server*.err")
        missing = [run["summary"] for run in runs if not Path(run["summary"]).is_file()]
        assert not missing, f"no summary {missing} (exit code {result.returncode}):\n{output[-8000:]}\n{server_logs}"
        reports = {name: json.loads(Path(run["summary"]).read_text()) for name, run in zip(CLIENT_RUNS, runs)}
        # The client server starts a server process per client on a port from 23000-24000, a range
        # every Ray Client server on this machine (other test sessions') picks from; its start
        # failed now and then here. That is Ray's, before any training: connect once more.
        first = reports["absolute"]
        if attempt == 1 and first.get("stage") == "connect" and "client server failed" in first["error"]:
            print(f"Ray Client connection failed, retrying:\n{first['error']}\n{server_logs}", file=sys.stderr)
            continue
        break
    assert result.returncode == 0, output[-8000:]
    return {name: (reports[name], base / name, f"{output[-4000:]}\n{server_logs}") for name in CLIENT_RUNS}


def _client_run(client_reports: dict, name: str) -> tuple[dict, Path]:
    """The summary of Ray Client run ``name`` and its working directory; fails with what went wrong."""
    report, workdir, diagnostics = client_reports[name]
    assert "error" not in report, f"Ray Client {report['stage']} failed:\n{report['error']}\n{diagnostics}"
    return report, workdir


class NotOnDriver(AssertionError):
    """A file rank 0 wrote (checkpoint or log) is not on the driver's machine where Lightning says it is."""


def _check_client_fit(report: dict, workdir: Path) -> None:
    """What a user looks at after fit under Ray Client; missing files raise :class:`NotOnDriver`."""
    assert report["client_mode"], "the driver was not connected through Ray Client"
    assert report["weights_changed"], "the trained weights did not come back to the driver's module"
    assert report["table_intact"], "the module's 2 MB buffer did not reach the workers (launch.weights_out)"
    assert "val_loss" in report["callback_metrics"] and report["global_step"] == 8
    assert report["current_epoch"] == 2

    best = workdir / report["best_model_path"]  # a relative path is relative to the driver's cwd
    if not best.is_file() or not best.is_relative_to(workdir):
        raise NotOnDriver(f"best checkpoint {report['best_model_path']!r} is not a file under {workdir}")
    assert "restore_error" not in report, report.get("restore_error")
    assert report["restored_lr"] == 0.1
    assert report["last_matches_model"], "last.ckpt does not hold the weights the driver's module got back"

    csv = report["metrics_csv_text"]
    if csv is None or not report["tb_events"]:
        raise NotOnDriver(
            f"metrics.csv found: {csv is not None}, TensorBoard event files found: {report['tb_events']}, "
            f"in the loggers' log_dirs {report['log_dirs']} under {workdir}"
        )
    rows = csv.strip().splitlines()
    assert rows[0].split(",")[:2] == ["epoch", "step"] and "val_loss" in rows[0]
    # log_every_n_steps=1: a row per training step and one per validation, 2 epochs x 4 steps.
    assert len(rows) - 1 == 8 + 2, csv


@pytest.mark.timeout(600)
def test_ray_client_fabric_launch_returns_rank_zeros_value_and_its_files(client_reports):
    """``fabric.launch`` from a Ray Client driver, workers on the worker node: rank 0's value and its save came home."""
    report, workdir = _client_run(client_reports, "absolute")
    fabric = report["fabric"]
    assert "error" not in fabric, fabric.get("error")
    assert fabric["result"]["world_size"] == 2
    assert fabric["checkpoint"] == str(workdir / "fabric" / "state.ckpt") and fabric["checkpoint_step"] == 4
    assert fabric["checkpoint"] in fabric["transferred_files"], "sent home from the worker node"


@pytest.mark.timeout(600)
def test_ray_client_fit_brings_back_weights_metrics_checkpoints_and_logs(client_reports):
    """Loggers' save_dir an absolute path in the driver's working directory; workers on the worker node."""
    report, workdir = _client_run(client_reports, "absolute")
    _check_client_fit(report, workdir)
    assert all(Path(d).is_relative_to(workdir) for d in report["log_dirs"].values()), report["log_dirs"]
    # Rank 0 ran on another node than the driver's (the head, for Ray): the launcher sent the
    # checkpoints back.
    assert report["best_model_path"] in report["transferred_files"], report["transferred_files"]


@pytest.mark.timeout(600)
def test_ray_client_fit_with_relative_save_dir(client_reports):
    """``save_dir="logs"`` means the driver's working directory, although rank 0 runs elsewhere."""
    report, workdir = _client_run(client_reports, "relative")
    assert report["best_model_path"] in report["transferred_files"], report["transferred_files"]
    _check_client_fit(report, workdir)


@pytest.mark.timeout(600)
def test_ray_client_fit_with_rank_zero_on_the_head(client_reports):
    """``save_dir="logs"`` with the workers on the head node, where Ray places the client's driver: the
    client's machine is still another one, so the files come back."""
    report, workdir = _client_run(client_reports, "head")
    _check_client_fit(report, workdir)


# -- stopping one cluster leaves every other Ray alone ----------------------------------------------


@ray.remote
def _ping() -> str:
    return "pong"


@pytest.mark.timeout(240)
def test_stopping_a_cli_cluster_stops_only_that_cluster(ray_local, two_node_cluster):
    other = two_node_cluster  # another CLI cluster on this machine, already running for the jobs above
    with CliCluster.start(num_cpus=0) as stopped:
        sessions = {node.process.pid for node in stopped.nodes}
        assert processes_in_sessions(sessions)
    assert not processes_in_sessions(sessions), "processes of the stopped cluster are still running"
    assert not stopped.temp_dir.exists()
    assert all(node.process.poll() is None for node in other.nodes)
    assert len(other.alive_nodes()) == len(other.nodes) == 2, "the other cluster stopped answering"
    assert ray.get(_ping.remote(), timeout=120) == "pong", "the test session's own Ray stopped working"


@pytest.mark.timeout(240)
def test_a_node_whose_raylet_missed_rays_startup_wait_is_started_again(monkeypatch):
    """Ray's `ray start` waits a fixed 30 s for its raylet to register; on 2 busy cores a joining node missed it
    once. The harness starts such a node again, once, instead of failing every test on the cluster."""
    real_spawn = CliCluster._spawn
    first_starts = []

    def spawn(self, label, args, num_cpus, resources, node_dir, log):
        if label == "worker1" and not first_starts:  # as `ray start` ends when the wait runs out
            with open(log, "ab") as out:
                first_starts.append(
                    subprocess.Popen(
                        [sys.executable, "-c", f"print({STARTUP_TIMED_OUT!r}); raise SystemExit(1)"],
                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    )
                )  # fmt: skip
            return first_starts[0]
        return real_spawn(self, label, args, num_cpus, resources, node_dir, log)

    monkeypatch.setattr(CliCluster, "_spawn", spawn)
    with CliCluster.start(num_cpus=0) as cluster:
        cluster.add_node(num_cpus=1, resources={"again": 1})
        cluster.wait_for_nodes(2)
        (worker,) = [node for node in cluster.nodes if node.label == "worker1"]
        assert worker.started_again and worker.process is not first_starts[0]
        assert first_starts[0].returncode == 1
        assert {n["node_name"] for n in cluster.alive_nodes()} == {"head", "worker1"}
