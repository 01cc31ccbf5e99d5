"""Spot clusters: elastic RayStrategy against a fixed size and Ray Train's elastic training, a node lost and back.

    .venv/bin/python -m benchmarks.elastic         # from the repository root; see benchmarks/README.md

Every contender trains the same fixed number of samples (``--epochs`` epochs of the same generated data, the same
seed, the same global batch at every world size) and its final weights are evaluated the same way, in the driver
(:mod:`benchmarks.elastic_driver`), each in a fresh driver process. They run on one ``ray.cluster_utils.Cluster``
owned by this process: a head with no CPU (the drivers' node; Ray Train's controller goes there too) and three worker
nodes of 1 CPU, each holding one worker; every measurement starts with three alive worker nodes and none of its
workers (they end with their driver's job). The cluster has no autoscaler: the harness adds the node back. The
harness's main thread plays the spot pattern,
reading rank 0's progress from the file the workers append to after every batch
(:class:`~benchmarks.elastic_driver.SpotProgress`), never a wall-clock sleep:

- at ``--lose-at`` (30%) of the samples, one worker node is removed (``Cluster.remove_node``): the node of the highest
  rank that is not rank 0's, as the workers of the current attempt recorded it (never the head);
- a node with the same resources (1 CPU) is added back at ``--back-at`` (60%) of the samples: rank 0's progress, for
  the elastic RayStrategy and for Ray Train alike (Ray Train runs the same Lightning module, Trainer and progress
  callback inside its ``train_loop_per_worker``: its rank 0 writes the same file; Ray Train's own ``report`` is not
  used for the pattern, only for its checkpoints);
- the fixed-size ``RayStrategy(num_workers=3, max_failures=3)`` makes no progress while the node is away: its
  restart waits up to 30 s for Ray to place the lost node's workers again (a node back by then: it goes on in the
  survivors' processes); after that, on a cluster without an autoscaler, it fails with ``ClusterResourceError``
  (the alive nodes can never hold 3 workers), and the driver does what a job scheduler would, waits until the
  cluster holds 3 workers again and fits again from the newest epoch-end checkpoint (``ModelCheckpoint``). Its
  node comes back after a wall time: the absence of the elastic run of the same round (loss → node added back,
  measured there), or ``--absence-s`` where no elastic run of the round measured one. The node is away for as long
  for both, as the same spot market would keep it away; what differs is what each does meanwhile (the elastic run
  trains on 2 workers, the fixed one waits). Each round measures the elastic run first.
- the uninterrupted run (``RayStrategy(num_workers=3)``, no node lost) gives the reference accuracy and time.

The worker nodes are processes sharing this machine's cores, so the MLP alone would train about as fast on 2
workers as on 3: each training step also sleeps ``--sample-ms`` per sample of the worker's batch (the node's own
compute), which makes a worker's throughput its node's, as on separate machines. Ray Train's controller looks for
more workers every ``--resize-monitor-s`` (its ``elastic_resize_monitor_interval_s``); the elastic RayStrategy checks
at every epoch end (``grow_check_interval_s=0``).

The harness of :mod:`benchmarks.run` (its options, a fresh driver process per measurement, round-robin repeats,
:func:`benchmarks.run.publish`); a thread samples the machine's other load (:mod:`benchmarks.fabric_load`). Writes
``<out>/<name>.json`` (every sample, every event) and ``<out>/<name>.md`` (:mod:`benchmarks.elastic_report`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import psutil

from benchmarks import drivers, options, run
from benchmarks.elastic_driver import CONTENDERS, Contender, ElasticSpec, SpotPaths
from benchmarks.elastic_report import build, markdown, targets
from benchmarks.tune_workload import append_record, read_records

_SIZES = {"epochs": "epochs of the fixed number of samples (8)", "train_size": "samples per epoch (24000)"}
_FRACTIONS = {
    "sample_ms": "a node's compute per sample, ms (0.25)",
    "lose_at": "share of the samples when a node goes (0.3)",
    "back_at": "share of the samples when it is back (0.6)",
    "absence_s": "the fixed size's absence without one (30)",
    "resize_monitor_s": "Ray Train's resize interval (1)",
}
# The order of a round's measurements: the fixed size needs the absence that the elastic run of its round measured.
_ORDER = ("elastic", "ray_train", "fixed", "uninterrupted")
_POLL_S = 0.05
# Ray Train v2 for Ray Train's contender (Ray 2.60's default, made explicit).
CLUSTER_ENVIRONMENT = {"RAY_TRAIN_V2_ENABLED": "1"}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    repeats = (2, "rounds: fresh cluster and driver per measurement (2)")
    return options.parse(argv, __doc__, "elastic", CONTENDERS, ElasticSpec, _SIZES, repeats, _FRACTIONS, check=_check)


def _check(args: argparse.Namespace, spec: ElasticSpec) -> str | None:
    return None if 0 < spec.lose_at < spec.back_at < 1 else "need 0 < --lose-at < --back-at < 1"


@contextlib.contextmanager
def spot_cluster(spec: ElasticSpec, temp_dir: str, env: dict[str, str]) -> Iterator[Any]:
    """A ``ray.cluster_utils.Cluster`` owned by this process: a head without CPUs and ``spec.workers`` 1-CPU worker
    nodes; yields it. Other Ray clusters on the machine are left alone; this one is shut down afterwards."""
    import ray
    from ray.cluster_utils import Cluster

    port = run._free_port()
    address = f"{ray.util.get_node_ip_address()}:{port}"
    cluster = None
    # As benchmarks.run.ray_cluster: every process of the cluster inherits the environment and finds this cluster.
    with run.environment({**env, "RAY_ADDRESS": address}):
        try:
            head = {"num_cpus": 0, "gcs_server_port": port, "temp_dir": temp_dir, "include_dashboard": True,
                    "dashboard_port": run._free_port()}  # fmt: skip
            cluster = Cluster(initialize_head=True, head_node_args=head)
            for _ in range(spec.workers):
                add_worker_node(cluster)
            cluster.wait_for_nodes()
            yield cluster
        finally:
            if cluster is not None:
                cluster.shutdown()


def add_worker_node(cluster: Any) -> Any:
    """A worker node of 1 CPU: it holds one worker."""
    return cluster.add_node(num_cpus=1)


class SpotPattern:
    """Plays the spot pattern on ``cluster`` for one measurement, from rank 0's progress in ``paths.progress``.

    ``absence_s``: the node comes back that long after the loss (the ``"time"`` pattern); else at ``back_at``.
    Every event goes to ``paths.events`` and :attr:`events`. Runs in the main thread (a Ray node started from another
    thread cannot install its signal handlers)."""

    def __init__(self, cluster: Any, paths: SpotPaths, spec: ElasticSpec, contender: Contender, absence_s: float):
        self.cluster, self.paths, self.spec, self.contender, self.absence_s = cluster, paths, spec, contender, absence_s
        self.events: list[dict[str, Any]] = []
        self.error: str | None = None
        self._offset, self._fraction = 0, 0.0
        self.started = time.time()

    @property
    def fraction(self) -> float:
        """Rank 0's progress as last read."""
        return self._fraction

    def play(self, running: threading.Thread) -> None:
        """Until ``running`` (the measurement) ends; an error of the pattern is recorded, not raised."""
        try:
            self._play(running)
        except Exception as error:  # noqa: BLE001 - recorded: the measurement is judged with it
            self.error = repr(error)
        running.join()

    def _play(self, running: threading.Thread) -> None:
        lost: dict[str, Any] | None = None
        while running.is_alive():
            running.join(_POLL_S)
            fraction = self._progress()
            if lost is None:
                if fraction >= self.spec.lose_at:
                    lost = self._lose(fraction)
                continue
            if self.contender.pattern == "time":
                due = time.time() - lost["t"] >= self.absence_s
            else:
                due = fraction >= self.spec.back_at
            if due:
                self._record("back", time.time(), fraction, add_worker_node(self.cluster).node_id)
                return

    def _progress(self) -> float:
        """The newest fraction rank 0 appended (whole lines only)."""
        if not os.path.exists(self.paths.progress):
            return self._fraction
        with open(self.paths.progress) as f:
            f.seek(self._offset)
            text = f.read()
        lines = text[: text.rfind("\n") + 1]
        self._offset += len(lines.encode())
        for line in lines.splitlines():
            if line.strip():
                self._fraction = json.loads(line)["fraction"]
        return self._fraction

    def _lose(self, fraction: float) -> dict[str, Any]:
        """Remove the node of the highest rank other than rank 0 (as the newest attempt's ranks recorded it)."""
        newest: dict[int, str] = {}
        for record in read_records(self.paths.ranks):
            newest[record["rank"]] = record["node_id"]
        nodes = {node.node_id: node for node in self.cluster.worker_nodes}
        chosen = [(rank, node) for rank, node in sorted(newest.items(), reverse=True)
                  if rank != 0 and node in nodes and node != newest.get(0)]  # fmt: skip
        if chosen:
            rank, node_id = chosen[0]
        else:  # no rank recorded a node (should not happen): any worker node that is not rank 0's
            rank, node_id = None, next(n for n in nodes if n != newest.get(0))
        t = time.time()
        self.cluster.remove_node(nodes[node_id])
        return self._record("lost", t, fraction, node_id, rank=rank)

    def _record(self, event: str, t: float, fraction: float, node_id: str, **extra: Any) -> dict[str, Any]:
        record = {"event": event, "t": t, "done": time.time(), "fraction": fraction, "node_id": node_id, **extra}
        self.events.append(record)
        append_record(self.paths.events, record)
        return record


def _absence(results: list[dict[str, Any]], repeat: int, spec: ElasticSpec) -> tuple[float, str]:
    """The fixed size's absence in round ``repeat``: the elastic run's of that round, else --absence-s."""
    for result in results:
        if result["contender"] == "elastic" and result["repeat"] == repeat and result.get("absence_s"):
            return result["absence_s"], "the elastic run of its round"
    return spec.absence_s, "--absence-s (no elastic run measured one in its round)"


def _measure_one(
    cluster: Any,
    contender: Contender,
    spec: ElasticSpec,
    scratch: str,
    log_path: str,
    env: dict[str, str],
    args: Any,
    absence: float,
) -> dict[str, Any]:
    """The spot pattern on ``cluster`` around one driver process; the driver's result plus the pattern's events."""
    _full_cluster(cluster, spec)
    directory = tempfile.mkdtemp(prefix="m", dir=scratch)
    result_path = os.path.join(directory, "result.json")
    spec_path = os.path.join(directory, "spec.json")
    with open(spec_path, "w") as f:
        f.write(replace(spec, ray_address=cluster.address, scratch=directory).to_json())
    outcome: dict[str, Any] = {}

    def drive() -> None:
        try:
            outcome["result"] = drivers.measure_once(contender.name, spec_path, result_path, log_path, env,
                                                     args.timeout, "benchmarks.elastic_driver")  # fmt: skip
        except RuntimeError as error:
            outcome["error"] = error

    driver = threading.Thread(target=drive, name=f"driver-{contender.name}", daemon=True)
    driver.start()
    pattern = SpotPattern(cluster, SpotPaths.under(result_path), spec, contender, absence)
    try:
        if contender.pattern is not None:
            pattern.play(driver)
        driver.join()
    finally:
        if driver.is_alive():  # leaving early (SIGTERM): the driver's process group goes first
            _kill_drivers()
            driver.join(timeout=60)
    if "error" in outcome:  # what the pattern did says where the driver got stuck
        events = ", ".join(f"{e['event']} at {e['fraction']:.0%} ({e['t'] - pattern.started:.1f} s)"
                           for e in pattern.events)  # fmt: skip
        raise RuntimeError(f"{outcome['error']}\nthe spot pattern: {events or 'no event'}; rank 0's progress "
                           f"{pattern.fraction:.0%}") from outcome["error"]  # fmt: skip
    result = outcome["result"]
    events = {e["event"]: e for e in pattern.events}
    result.update(events=pattern.events, pattern_error=pattern.error)
    result["absence_s"] = events["back"]["t"] - events["lost"]["t"] if len(events) == 2 else None
    if contender.pattern == "time":
        result["absence_planned_s"] = absence
    return result


def _full_cluster(cluster: Any, spec: ElasticSpec) -> None:
    """Every measurement starts with ``spec.workers`` alive worker nodes (a failed one may have left one out)."""
    for _ in range(spec.workers - len(cluster.worker_nodes)):
        add_worker_node(cluster)
    cluster.wait_for_nodes()


def _kill_drivers() -> None:
    """SIGKILL the process group of each driver process this harness started (each in a session of its own; with
    tiny sizes, forked by the warm process of :class:`benchmarks.measure.WarmDriver`, whose command line it has)."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            command = child.cmdline()
            if ("benchmarks.elastic_driver" in command or "--warm" in command) and os.getpgid(child.pid) == child.pid:
                os.killpg(child.pid, signal.SIGKILL)


def _measure_all(args: argparse.Namespace, spec: ElasticSpec, env: dict[str, str], logs: Path) -> tuple[list, list]:
    """Every contender ``args.repeats`` times, round by round in :data:`_ORDER`, on one cluster (each measurement
    starts with all its worker nodes alive, none of them holding a worker: each driver's job ends with it)."""
    chosen = args.contenders.split(",")
    results: list[dict[str, Any]] = []
    with run.scratch_dir("rle-") as scratch, spot_cluster(spec, os.path.join(scratch, "ray"), env) as cluster:

        def measure(name: str, repeat: int) -> dict[str, Any]:
            absence, source = _absence(results, repeat, spec)
            log_path = str(logs / f"{name}-{repeat}.log")
            result = _measure_one(cluster, CONTENDERS[name], spec, scratch, log_path, env, args, absence)
            return {**result, "absence_source": source} if CONTENDERS[name].pattern == "time" else result

        names = [n for n in _ORDER if n in chosen]
        return run.rounds(args.repeats, names, measure, logs, (RuntimeError, TimeoutError), results)


def _other_load(result: dict[str, Any], load: Any) -> None:
    result["other_load_cores"] = load.cores(result["t0"], result["t1"])


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    judge = run.tables(args, build, targets, with_spec=True)
    measure = partial(_measure_all, args, args.spec)
    return run.benchmark(args, argv, "elastic", measure, judge, markdown, CLUSTER_ENVIRONMENT,
                         _other_load)  # fmt: skip


if __name__ == "__main__":
    run.entry(main)
