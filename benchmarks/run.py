"""Run the benchmark: every contender, ``--repeats`` times, each in a fresh driver process.

    .venv/bin/python -m benchmarks.run                 # from the repository root; see benchmarks/README.md

Starts one local Ray cluster for the whole run (in this process, in a private temp directory; it
stops with this process), which the Ray contenders' drivers connect to before their timers start.
Measurements go round-robin over the contenders, so a noisy stretch of time hits all of them.
Writes ``<out>/<name>.json`` (every sample) and ``<out>/<name>.md`` and prints the markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, replace
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks import plots, report
from benchmarks.contenders import CONTENDERS
from benchmarks.drivers import ROOT, _measure_or_again, measure_once
from benchmarks.options import add_run_options, add_sizes, parse_run_options, sized, sizes_of
from benchmarks.workload import Spec

_SIZES = {
    "steps": "optimizer steps per fit (60)",
    "warmup": "steps left out of the step time (10)",
    "batch_size": "per worker (128)",
    "hidden": "width of the MLP's hidden layers (1024)",
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="fresh driver processes per contender (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="training processes per fit (default 2)")
    parser.add_argument("--params", type=float, default=None, help="parameters of the weights-back model (250e6)")
    add_sizes(parser, _SIZES)
    add_run_options(parser, CONTENDERS, "the start time")
    args = parse_run_options(parser, argv, CONTENDERS)
    args.spec = sizes_of(args, Spec.tiny() if args.tiny else Spec(), _SIZES)
    args.spec.workers = args.workers
    sized(args.spec, {"weights_params": None if args.params is None else int(args.params)})
    return args


def _threads_per_process(workers: int) -> int:
    # The same for every contender: the cores shared by the training processes, as Lightning's own
    # launchers choose when OMP_NUM_THREADS is unset (Ray sets it to the CPUs an actor reserved).
    return max(1, (os.cpu_count() or 1) // workers)


def _environment(threads: int) -> dict[str, str]:
    """What the Ray cluster's processes and every driver inherit."""
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": str(threads), "RAY_USAGE_STATS_ENABLED": "0"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def ray_cluster(num_cpus: int, temp_dir: str, env: dict[str, str], num_gpus: int | None = None) -> Iterator[str]:
    """A local Ray head owned by this process; yields its address. Other Ray clusters on the machine are left alone.

    ``num_gpus``: the GPUs it offers (None: those Ray finds)."""
    import ray

    # Ray processes that look for "the" cluster (Ray Train's placement group cleaner uses the state
    # API) must find this one, also where other clusters run on the machine: fix the GCS port up
    # front and give its address to every process of the cluster.
    port = _free_port()
    address = f"{ray.util.get_node_ip_address()}:{port}"
    # The raylet and the workers it starts inherit this process's environment.
    with environment({**env, "RAY_GCS_SERVER_PORT": str(port), "RAY_ADDRESS": address}):
        # include_dashboard=None: the dashboard (the state API behind it) where its packages are installed;
        # a trimmed Ray (the GPU pack) has none and still runs every contender but Ray Train's cleaner.
        context = ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=None,
                           _temp_dir=temp_dir, log_to_driver=False)  # fmt: skip
        try:
            if context.address_info["gcs_address"] != address:
                raise RuntimeError(f"Ray started at {context.address_info['gcs_address']}, not at {address}")
            yield address
        finally:
            # Stops the processes this ray.init started, and only those; they would also die with this process.
            ray.shutdown()


@contextlib.contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """This process's environment with ``variables`` in the block (what it starts meanwhile inherits them), as it
    was before afterwards."""
    saved = dict(os.environ)
    os.environ.update(variables)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _machine(threads: int) -> dict[str, Any]:
    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpus": os.cpu_count(),
        "gpus": gpu_names(),
        "memory_gb": memory,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "threads_per_process": threads,
        "ray_train_v2": os.environ.get("RAY_TRAIN_V2_ENABLED", "1") not in ("0", "false", "False"),
        **{p.replace("-", "_"): version(p) for p in ("torch", "pytorch-lightning", "ray", "horovod", "ray_lightning")},
    }


def gpu_names() -> list[str]:
    """The NVIDIA GPUs of this machine as ``nvidia-smi`` names them (this process starts no CUDA); [] where none."""
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in listed.stdout.splitlines() if line.strip()] if listed.returncode == 0 else []


@contextlib.contextmanager
def scratch_dir(prefix: str = "rlb-") -> Iterator[str]:
    """A private temp folder, removed afterwards; short, for Ray's socket paths under it stay within the OS's limit."""
    scratch = tempfile.mkdtemp(prefix=prefix, dir="/tmp" if os.path.isdir("/tmp") else None)
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def rounds(
    repeats: int,
    names: Iterable[str],
    measure: Callable[[str, int], dict[str, Any]],
    logs: Path | None = None,
    failures: tuple[type[BaseException], ...] = (RuntimeError,),
    results: list[dict[str, Any]] | None = None,
) -> tuple[list, list]:
    """``measure(name, repeat)`` for every name, ``repeats`` times, round-robin (a noisy stretch of time hits them
    all); returns the measurements (each with its ``repeat``, appended to ``results`` as they come) and the
    failures (with the log under ``logs``)."""
    names = list(names)
    results = [] if results is None else results
    errors: list[dict[str, Any]] = []
    started = time.time()
    for repeat, name in ((r, n) for r in range(repeats) for n in names):
        print(f"[{time.time() - started:5.0f} s] {name}, repeat {repeat + 1}/{repeats}", flush=True)
        try:
            result = measure(name, repeat)
        except failures as error:
            print(error, file=sys.stderr, flush=True)
            log = {"log": str(logs / f"{name}-{repeat}.log")} if logs is not None else {}
            errors.append({"contender": name, "repeat": repeat, "error": str(error), **log})
            continue
        results.append({**result, "repeat": repeat})
    return results, errors


def _measure_all(
    args: argparse.Namespace,
    spec: Spec,
    env: dict[str, str],
    logs: Path,
    entry: str = "benchmarks.measure",
    num_cpus: int | None = None,
) -> tuple[list, list]:
    """Every contender ``args.repeats`` times, round-robin, each in ``python -m entry`` (once more after a crash);
    returns the measurements and the failures."""
    with scratch_dir() as scratch:
        # As many CPUs as the workers reserve (Ray Train's controller and helper actors reserve none), or those a
        # spec asks for (Tune's trials reserve their own process too), and a GPU each where they train on GPUs.
        num_gpus = spec.workers if getattr(spec, "gpu", False) else None
        num_cpus = num_cpus or getattr(spec, "cluster_cpus", spec.workers)
        with ray_cluster(num_cpus, os.path.join(scratch, "ray"), env, num_gpus) as address:
            spec_path = os.path.join(scratch, "spec.json")
            with open(spec_path, "w") as f:
                f.write(replace(spec, ray_address=address, scratch=scratch).to_json())

            def measure(contender: str, repeat: int) -> Any:
                def once(result_path: str, log_path: str) -> Any:
                    return measure_once(contender, spec_path, result_path, log_path, env, args.timeout, entry)

                return _measure_or_again(contender, repeat, scratch, logs, once)

            return rounds(args.repeats, args.contenders.split(","), measure, logs)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    # Unwinds through the `finally` blocks: the driver process group is killed and Ray is stopped.
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    measure = partial(_measure_all, args, args.spec)
    return benchmark(args, argv, "run", measure, tables(args, report.build, report.targets), report.markdown)


def output_dirs(args: argparse.Namespace, prefix: str) -> tuple[str, Path, Path]:
    """A run's name (``--name``, or ``<prefix>-<start time>``), its output folder and its log folder (made)."""
    name = args.name or time.strftime(("" if prefix == "run" else f"{prefix}-") + "%Y%m%d-%H%M%S")
    out = Path(args.out)
    logs = out / "logs" / name
    logs.mkdir(parents=True, exist_ok=True)
    return name, out, logs


def describe(name: str, module: str, argv: list[str] | None, started: float, repeats: int, spec: Any) -> dict[str, Any]:
    """What every benchmark document starts with: the run, the command that made it, its size and the machine."""
    return {
        "name": name,
        "command": " ".join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)]),
        "duration_s": time.time() - started,
        "repeats": repeats,
        "spec": asdict(spec),
        "machine": _machine(_threads_per_process(spec.workers)),
    }


def publish(document: dict[str, Any], text: str, out: Path, logs: Path) -> int:
    """Write ``document`` to ``<out>/<name>.json`` and ``text`` to ``.md``, print it; 1 after a failed measurement."""
    name = document["name"]
    (out / f"{name}.json").write_text(json.dumps(document, indent=1) + "\n")
    (out / f"{name}.md").write_text(text)
    print(text)
    figures = plots.draw(out / f"{name}.json")  # its main figures, beside it (benchmarks.plots)
    drawn = f", {', '.join(f.name for f in figures)}" if figures else ""
    print(f"Wrote {out / name}.json and .md{drawn}; driver logs in {logs}", flush=True)
    return 1 if document["errors"] else 0


def benchmark(
    args: argparse.Namespace,
    argv: list[str] | None,
    prefix: str,
    measure: Callable[[dict[str, str], Path], tuple[list, list]],
    judge: Callable[[list, list], dict[str, Any]],
    markdown: Callable[[dict[str, Any]], str],
    env: dict[str, str] | None = None,
    other_load: Callable[[dict[str, Any], Any], None] | None = None,
    started: float | None = None,
) -> int:
    """What every benchmark's ``main`` does: its output folders, the environment of its processes, ``measure(env,
    logs)`` (sampling the machine's other load, ``other_load(result, load)`` into each result, where given), its
    document (:func:`describe`, the load, ``judge(results, errors)``, the failures and every measurement) and
    :func:`publish`. ``python -m benchmarks.<prefix>``."""
    from benchmarks.fabric_load import OtherLoad

    spec = args.spec
    name, out, logs = output_dirs(args, prefix)
    env = {**_environment(_threads_per_process(spec.workers)), **(env or {})}
    loadavg_before = os.getloadavg()
    with OtherLoad() if other_load else contextlib.nullcontext() as load:
        started = started or time.time()
        results, errors = measure(env, logs)
        ended = time.time()
    document = describe(name, f"benchmarks.{prefix}", argv, started, args.repeats, spec)
    if other_load:
        for result in results:
            other_load(result, load)
        samples = {"loadavg_before": loadavg_before, "other_cores": load.cores(started, ended), "samples": load.samples}
        document["load"] = samples
    document.update(judge(results, errors), errors=errors, measurements=results)
    return publish(document, markdown(document), out, logs)


def tables(
    args: argparse.Namespace,
    build: Callable[..., dict[str, Any]],
    judge: Callable[[dict[str, Any]], list],
    key: str = "targets",
    with_spec: bool = False,
) -> Callable[[list, list], dict[str, Any]]:
    """The ``judge`` of :func:`benchmark` for a benchmark with one table: ``build(results, the contenders)`` (and
    ``args.spec``, ``with_spec``) under ``table``, its goals ``judge(table)`` under ``key``."""

    def judged(results: list, errors: list) -> dict[str, Any]:
        table = build(results, args.contenders.split(","), *((args.spec,) if with_spec else ()))
        return {"table": table, key: judge(table)}

    return judged


def entry(main: Callable[[], int]) -> None:
    """``python -m benchmarks.<name>``: SIGTERM unwinds (the driver processes and Ray stop), the exit code is main's."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sys.exit(main())


if __name__ == "__main__":
    entry(main)
