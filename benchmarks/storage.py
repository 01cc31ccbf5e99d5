"""Checkpoints in storage (``storage_path``): memory, the training time a checkpoint costs, resuming a lost driver.

    .venv/bin/python -m benchmarks.storage        # from the repository root; see benchmarks/README.md

Starts an S3 server on a loopback port (moto's server mode, in a process of its own) and a bucket in it,
then the harness of benchmarks.run: one local Ray cluster for the whole run, and round-robin over the cases
each measurement in a fresh driver process (python -m benchmarks.storage_driver), with the AWS_* variables
that point at the server. Three parts, on the sharded benchmark's model (benchmarks/sharded_workload.py):

* memory: the peak RSS of the driver and of each rank with max_failures=1, with and without storage_path,
  against a fit without recovery checkpoints;
* cost: how long each epoch-end checkpoint holds the training thread, the upload in the background against
  a save that waits for it, RayFSDPStrategy and RayStrategy, and Ray Train's RunConfig(storage_path=S3);
* resume: a driver SIGKILLed once its first checkpoint is complete in the bucket, the same script run again
  with the same run_name: its start to its first step, against a cold start.

Writes ``<out>/<name>.json`` (every sample) and ``<out>/<name>.md`` and prints the markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import psutil

from benchmarks import drivers, options, run
from benchmarks.storage_driver import CASES, FIRST_DRIVER, RAY_TRAIN_RUNS, RUNS, StorageSpec
from benchmarks.storage_report import build, goals, markdown

_SIZES = {
    "workers": "training processes per fit (default 2)",
    "blocks": "blocks of the memory part's model (16: 515 MB)",
    "steps": "optimizer steps per epoch, memory part (2)",
    "epochs": "epochs of a memory fit (2)",
    "cost_blocks": "blocks of the cost and resume parts' model (5: 168 MB, 505 MB with Adam's state)",
    "cost_steps": "optimizer steps per epoch, cost/resume (10)",
    "cost_epochs": "epochs of a cost or resume fit (3)",
    "warmup": "steps left out of the median step (4)",
}
_ENTRY = "benchmarks.storage_driver"
_MARKER = "COMPLETE.json"
_POLL_S = 0.2


def _check(args: argparse.Namespace, spec: StorageSpec) -> str | None:
    if spec.epochs < 1 or spec.cost_epochs < 2:
        return "a resume needs 2+ epochs (--cost-epochs): the driver is killed after the first epoch's"
    if spec.warmup >= spec.cost_steps * spec.cost_epochs:
        return "--warmup must leave steps of a cost fit to time"
    return None


def _parse(argv: list[str] | None) -> argparse.Namespace:
    repeats = (3, "fresh driver processes per case (default 3)")
    return options.parse(argv, __doc__, "storage", CASES, StorageSpec, _SIZES, repeats, check=_check)


# -- The S3 server ---------------------------------------------------------------------------------


def s3_environment(endpoint: str) -> dict[str, str]:
    """The variables a user sets for a bucket; the drivers forward them to their workers."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


@contextlib.contextmanager
def s3_server(log_path: Path, timeout_s: float = 60) -> Iterator[tuple[str, int]]:
    """moto's S3 server on a free loopback port, in a process (group) of its own; yields its endpoint URL and pid.

    Its own process: the uploads it serves take its CPU and its GIL, not this harness's (which polls the bucket).
    """
    port = run._free_port()
    command = [sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1", "-p", str(port)]
    with open(log_path, "w") as log, drivers.process_group(command, log) as server:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the S3 server did not start; end of {log_path}:\n{drivers.log_tail(log_path)}")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}", server.pid


class Bucket:
    """The run's bucket, seen from this process through s3fs (the drivers' ranks write with s3fs too)."""

    def __init__(self, endpoint: str) -> None:
        import s3fs

        env = s3_environment(endpoint)
        self.fs = s3fs.S3FileSystem(key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                                    endpoint_url=endpoint, skip_instance_cache=True)  # fmt: skip
        self.name = f"bench-{uuid.uuid4().hex[:8]}"
        self.fs.mkdir(self.name)

    @property
    def url(self) -> str:
        return f"s3://{self.name}"

    def markers(self, run_name: str) -> list[str]:
        """The markers of the complete recovery checkpoints of a ray_lightning run."""
        self.fs.invalidate_cache()
        return self.fs.glob(f"{self.name}/{RUNS}/{run_name}/recovery/*/{_MARKER}")

    def usage(self, folder: str) -> dict[str, Any]:
        """Bytes and files under ``folder`` of the bucket (0 where there is nothing)."""
        self.fs.invalidate_cache()
        path = f"{self.name}/{folder}"
        files = self.fs.find(path, detail=True) if self.fs.exists(path) else {}
        return {"mb": sum(f.get("size", 0) for f in files.values()) / 2**20, "files": len(files)}

    def remove(self, folder: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(f"{self.name}/{folder}", recursive=True)


# -- The measurements ------------------------------------------------------------------------------


class Harness:
    """What every measurement of a run shares: the sizes, the cluster, the bucket, the folders, the environment."""

    def __init__(self, args: argparse.Namespace, spec: StorageSpec, env: dict[str, str], logs: Path,
                 scratch: str, bucket: Bucket, server_pid: int) -> None:  # fmt: skip
        self.args, self.spec, self.env, self.logs, self.scratch, self.bucket = args, spec, env, logs, scratch, bucket
        self.server = psutil.Process(server_pid)

    def _server_cpu_s(self) -> float:
        """CPU seconds the S3 server has used (all its threads): it shares this machine's cores with training."""
        times = self.server.cpu_times()
        return times.user + times.system

    def _spec_file(self, label: str, run_name: str) -> str:
        path = os.path.join(self.scratch, f"{label}.spec.json")
        with open(path, "w") as f:
            f.write(replace(self.spec, run_name=run_name).to_json())
        return path

    def measure(self, case: str, repeat: int) -> dict[str, Any]:
        """One measurement of ``case`` (the resume case: its killed first driver, then the measured second)."""
        label = f"{case}-{repeat}"
        run_name = f"{case.replace('_', '-')}-{repeat}-{uuid.uuid4().hex[:6]}"
        spec_path = self._spec_file(label, run_name)
        result_path = os.path.join(self.scratch, f"{label}.json")
        folder = f"{RAY_TRAIN_RUNS if CASES[case].ray_train else RUNS}/{run_name}"
        try:
            killed = self._killed_first_driver(label, spec_path, run_name) if case == "resume" else None
            server_cpu = self._server_cpu_s()
            started = time.time()
            result = drivers.measure_once(case, spec_path, result_path, str(self.logs / f"{label}.log"), self.env,
                                          self.args.timeout, _ENTRY)  # fmt: skip
            ended = time.time()
            server_cpu = self._server_cpu_s() - server_cpu
            # What stays in the bucket: the newest checkpoint (ray_lightning: its recovery folder).
            stored = self.bucket.usage(folder if CASES[case].ray_train else f"{folder}/recovery")
        finally:
            self.bucket.remove(folder)  # the server keeps every object: keep its disk and memory in bounds
        metrics = result["metrics"]
        metrics["checkpoint_mb"] = stored["mb"] if CASES[case].checkpoints else None
        metrics["server_cpu_s"] = server_cpu
        if metrics.get("checkpoints"):
            metrics["server_cpu_per_checkpoint_s"] = server_cpu / metrics["checkpoints"]
        if CASES[case].part == "resume":
            # From the driver process's start, as a user who runs the script again sees it.
            metrics["start_first_step_s"] = result["clock_first_step"] - started
            metrics["start_to_end_s"] = ended - started
            metrics["kill_first_step_s"] = result["clock_first_step"] - killed["killed_at"] if killed else None
        return {**result, "run_name": run_name, "started_at": started, "ended_at": ended, "stored": stored,
                "killed": killed}  # fmt: skip

    def _killed_first_driver(self, label: str, spec_path: str, run_name: str) -> dict[str, Any]:
        """The resume case's first driver: SIGKILLed (its process group) once a recovery checkpoint of its run is
        complete in the bucket; the marker's header and the times."""
        log_path = self.logs / f"{label}-first.log"
        result_path = os.path.join(self.scratch, f"{label}-first.json")
        with open(log_path, "w") as log:
            started = time.time()
            with drivers.driver_process(_ENTRY, FIRST_DRIVER.name, spec_path, result_path, log, self.env) as process:
                markers = self._wait_for_marker(process, run_name, started + self.args.timeout)
                killed_at = time.time()
        if not markers:
            ended = "ended" if process.returncode not in (None, -signal.SIGKILL) else "was killed"
            raise RuntimeError(f"the first driver of {run_name} {ended} before a recovery checkpoint was complete in "
                               f"the bucket; end of {log_path}:\n{drivers.log_tail(log_path)}")  # fmt: skip
        header = json.loads(self.bucket.fs.cat_file(markers[0]))
        return {"started_at": started, "killed_at": killed_at, "marker": header,
                "marker_to_kill_s": killed_at - header["written_at"]}  # fmt: skip

    def _wait_for_marker(self, process: subprocess.Popen, run_name: str, deadline: float) -> list[str]:
        while time.time() < deadline and process.poll() is None:
            markers = self.bucket.markers(run_name)
            if markers:
                return markers
            time.sleep(_POLL_S)
        return []


def _measure_all(args: argparse.Namespace, spec: StorageSpec, env: dict[str, str], logs: Path) -> tuple[list, list]:
    """Every case ``args.repeats`` times, round-robin, each in a fresh driver process, against one S3 server and one
    Ray cluster; the measurements and the failures."""
    with run.scratch_dir() as scratch, s3_server(logs / "s3-server.log") as (endpoint, server_pid):
        env = {**env, **s3_environment(endpoint)}  # the cluster's processes and every driver
        bucket = Bucket(endpoint)
        with run.ray_cluster(spec.workers, os.path.join(scratch, "ray"), env) as address:
            spec = replace(spec, ray_address=address, scratch=scratch, bucket=bucket.url, endpoint=endpoint)
            harness = Harness(args, spec, env, logs, scratch, bucket, server_pid)
            return run.rounds(args.repeats, args.contenders.split(","), harness.measure)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    judge = run.tables(args, build, goals, "goals", with_spec=True)
    measure = partial(_measure_all, args, args.spec)
    return run.benchmark(args, argv, "storage", measure, judge, markdown)


if __name__ == "__main__":
    run.entry(main)
