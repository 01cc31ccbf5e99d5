"""One measurement: a fresh driver process runs one contender's three fits and writes what it saw.

    python -m benchmarks.measure --contender ray --spec spec.json --result result.json

Started by :mod:`benchmarks.run`, once per contender and repeat. In this process:

1. connect to the harness's Ray cluster (Ray contenders), before any timer starts;
2. ``fit`` #1 and ``fit`` #2 of :class:`BenchModule` (``spec.steps`` steps each), each with a new
   Trainer and module, timed from just before ``trainer.fit`` on the driver;
3. ``fit`` #3 of :class:`WeightsModule` (``spec.weights_steps`` steps), timed from rank 0's
   ``on_fit_end`` to the moment the driver's module holds the trained weights;
4. the driver's peak RSS, then the in-memory copy floor of the same state dict.

Lightning's ``ddp`` re-runs this command line for ranks > 0: they run the same fits and write nothing.
With tiny sizes (``spec.smoke``) the weights-back fit is fit #2 itself (:func:`fit_plan`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import resource
import runpy
import select
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch

from benchmarks import write_whole
from benchmarks.contenders import CONTENDERS, Contender
from benchmarks.workload import BenchModule, Spec, WeightsModule, read_clock

_FLOOR_TRIES = 3
# Tiny sizes (the smoke tests) measure nothing, so what only costs them time goes: Ray Train's controller polls its
# workers every 0.2 s instead of every 2 (it sees a worker group start, end or fail sooner) and starts no preemption
# watcher (one more actor process, started on the way to every worker group's start). The driver's environment: Ray
# Train passes these on to its controller.
SMOKE_ENVIRONMENT = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def _peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux: the high-water mark of this process only, not of its children.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _fit_metrics(spec: Spec, t0: float, t1: float, clock: dict[str, Any]) -> dict[str, Any]:
    """What one fit shows, from the driver's start/return times and rank 0's clock."""

    def steady(times: list[float]) -> float | None:
        durations = [b - a for a, b in zip(times, times[1:])]  # durations[j] is step j+1's
        window = durations[max(spec.warmup - 1, 0) :]
        return statistics.median(window) if window else None

    return {
        "wall_s": t1 - t0,
        "first_step_s": clock["first_optimizer_step"] - t0,
        # Where the time to the first step goes: until rank 0's on_fit_start, then until its first batch.
        "launch_s": clock["fit_start"] - t0,
        "setup_s": clock["first_batch_start"] - clock["fit_start"],
        "step_s": steady(clock["batch_ends"]),
        "step_cpu_s": steady(clock["batch_end_cpu"]),
        "steps": len(clock["batch_ends"]),
        # From rank 0's on_fit_end until fit returned here.
        "return_s": t1 - clock["fit_end"],
        "worker_threads": clock["threads"],
        "world_size": clock["world_size"],
    }


def _copy_floor(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """The best of a few plain in-memory copies of ``state``: fresh tensors, and into preallocated ones."""
    clone_s, copy_s = [], []
    targets = {k: torch.empty_like(v) for k, v in state.items()}
    for _ in range(_FLOOR_TRIES):
        start = time.perf_counter()
        copies = {k: v.clone() for k, v in state.items()}
        clone_s.append(time.perf_counter() - start)
        del copies
        start = time.perf_counter()
        for k, v in state.items():
            targets[k].copy_(v)
        copy_s.append(time.perf_counter() - start)
    return {"clone_s": min(clone_s), "copy_into_s": min(copy_s)}


def _weights_changed(before: torch.Tensor, module: BenchModule) -> bool:
    return not torch.equal(before, module.net[0].weight.detach())


def fit_plan(spec: Spec) -> tuple[tuple[str, type[BenchModule], int], ...]:
    """The fits of a measurement (label, module, steps): two of :class:`BenchModule`, then the weights-back fit.

    With tiny sizes (``spec.smoke``) the second fit is the weights-back fit, a launch less for the same paths (a
    second fit in the process, the weights coming back); its record is both ``fit2`` and ``weights``."""
    first, second = ("fit1", BenchModule, spec.steps), ("fit2", BenchModule, spec.steps)
    if spec.smoke:
        return first, ("fit2", WeightsModule, spec.steps)
    return first, second, ("weights", WeightsModule, spec.weights_steps)


def measure(contender: Contender, spec: Spec, result_path: str, record: bool) -> dict[str, Any] | None:
    """Run the fits; return the measurement (None on ranks > 0 of ``ddp``)."""
    if contender.uses_ray:
        import ray

        ray.init(address=spec.ray_address, log_to_driver=True)
    fits: dict[str, dict[str, Any]] = {}
    rss_small = 0.0
    module: BenchModule | None = None
    for label, cls, steps in fit_plan(spec):
        module = cls(spec)
        before = module.net[0].weight.detach().clone()
        clock_path = f"{result_path}.{label}.clock"
        t0 = time.time()
        contender.fit(spec, module, clock_path, steps)
        t1 = time.time()
        if not record:
            continue
        fits[label] = _fit_metrics(spec, t0, t1, read_clock(clock_path))
        fits[label]["weights_changed"] = _weights_changed(before, module)
        if label == "fit2":
            rss_small = _peak_rss_mb()
    if not record or module is None:
        return None
    fits.setdefault("weights", fits["fit2"])
    peak_rss = _peak_rss_mb()  # before the floor's copies add their own
    state = module.state_dict()
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    floor = _copy_floor(state)
    weights_back_s = None if contender.driver_is_rank_zero else fits["weights"]["return_s"]
    return {
        "contender": contender.name,
        "pid": os.getpid(),
        "driver_threads": torch.get_num_threads(),
        "fits": fits,
        "metrics": {
            "fit_s": fits["fit1"]["wall_s"],
            "first_step_s": fits["fit1"]["first_step_s"],
            "step_ms": fits["fit1"]["step_s"] * 1000 if fits["fit1"]["step_s"] is not None else None,
            "fit2_s": fits["fit2"]["wall_s"],
            "fit2_first_step_s": fits["fit2"]["first_step_s"],
            "weights_back_s": weights_back_s,
            "weights_floor_s": floor["clone_s"],
            "weights_speed_vs_copy": floor["clone_s"] / weights_back_s if weights_back_s else None,
            "peak_rss_mb": peak_rss,
            "peak_rss_small_mb": rss_small,
        },
        "weights_bytes": nbytes,
        "floor": floor,
    }


def _launched_by_lightning_ddp() -> bool:
    # Lightning's ddp starts ranks > 0 with LOCAL_RANK set; the harness never sets it.
    return os.environ.get("LOCAL_RANK", "0") != "0"


def main(argv: list[str] | None = None) -> None:
    if argv is None and sys.argv[1:] == ["--warm"]:
        return _warm_server()
    measurement_main(argv, __doc__, CONTENDERS, Spec, measure)


# -- Tiny sizes: warm drivers. A driver process spends ~7 CPU-s importing torch, Lightning, Ray and ray_lightning
# before it measures anything, once per measurement; a smoke run, which measures nothing, has tens of them. With
# tiny sizes the harness instead starts one process that imports those once (``python -m benchmarks.measure
# --warm``, at the first measurement: after the Ray cluster started, with the environment a driver gets, as Ray
# reads its authentication token at import) and forks each driver from it: still a fresh process per measurement
# (its own pid, session and log; Ray not initialized in it), running ``python -m <entry>``'s code as ``__main__``.
# The real runs start every driver with ``python -m <entry>`` (:func:`benchmarks.drivers.measure_once`).
_PRELOAD = ("lightning.pytorch", "ray", "ray_lightning", "ray.train.torch", "ray.train.lightning")


def _warm_server() -> None:
    """Imports :data:`_PRELOAD`, then per request line ``{"entry", "args", "log", "env"}`` on stdin imports the
    entry module, forks a driver, answers ``{"pid"}``, waits for it and answers ``{"code"}`` (as
    ``Popen.returncode``); ends at EOF."""
    for name in _PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    for line in sys.stdin:
        request = json.loads(line)
        with contextlib.suppress(Exception):  # where it fails, the driver fails the same way and logs why
            importlib.import_module(request["entry"])
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _forked_driver(request["entry"], request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


def _forked_driver(entry: str, request: dict[str, Any]) -> None:
    """In the forked child: its own session, its log as stdout and stderr, then ``python -m entry *args``."""
    code = 1
    try:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [entry, *request["args"]]
        runpy.run_module(entry, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else int(done.code is not None)
    except BaseException:  # noqa: BLE001 - reported in the driver's log, as an uncaught exception would be
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class WarmDriver:
    """The harness's side of :func:`_warm_server`: :meth:`run` is ``Popen(python -m entry *args).wait(timeout)``."""

    _started: WarmDriver | None = None

    def __init__(self, env: dict[str, str], cwd: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "benchmarks.measure", "--warm"], cwd=cwd, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)  # fmt: skip

    @staticmethod
    def wanted(spec_path: str) -> bool:
        """Whether the sizes at ``spec_path`` are tiny (``smoke``); a file that is not there: no."""
        try:
            with open(spec_path) as f:
                return bool(json.load(f).get("smoke"))
        except (OSError, ValueError):
            return False

    @classmethod
    def of(cls, env: dict[str, str], cwd: str) -> WarmDriver:
        """The warm process, started at its first use (it ends when this process closes its stdin, at exit)."""
        if cls._started is None or cls._started.process.poll() is not None:
            cls._started = cls(env, cwd)
        return cls._started

    def run(self, entry: str, args: list[str], log_path: str, env: dict[str, str], timeout: float) -> int | None:
        """A driver forked with ``args``: its exit code, None past ``timeout``; its process group is killed after."""
        assert self.process.stdin is not None and self.process.stdout is not None
        request = {"entry": entry, "args": args, "log": log_path, "env": env}
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        pid = self._answer()["pid"]
        try:
            if not select.select([self.process.stdout], [], [], timeout)[0]:
                os.killpg(pid, signal.SIGKILL)
                self._answer()
                return None
            return self._answer()["code"]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)

    def _answer(self) -> dict[str, Any]:
        line = b""
        while not line.endswith(b"\n"):
            byte = self.process.stdout.read(1)  # type: ignore[union-attr]
            if not byte:
                raise RuntimeError(f"the warm driver process ended (exit code {self.process.wait()})")
            line += byte
        return json.loads(line)


def measurement_main(
    argv: list[str] | None,
    description: str | None,
    contenders: Mapping[str, Any],
    spec_class: type[Spec],
    measure_fn: Callable[..., dict[str, Any] | None],
) -> None:
    """A measurement process's command line: ``--contender``, ``--spec`` (a ``spec_class`` as JSON), ``--result``.

    Writes ``measure_fn(contender, spec, result_path, record)``'s measurement to ``--result`` (whole
    or not at all); ranks that Lightning's launcher started record and write nothing. With tiny sizes
    (``spec.smoke``) the process runs with :data:`SMOKE_ENVIRONMENT` and leaves at once after that.
    """
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contender", required=True, choices=sorted(contenders))
    parser.add_argument("--spec", required=True, help="JSON file with the sizes (a benchmarks.workload.Spec)")
    parser.add_argument("--result", required=True, help="where to write this measurement as JSON")
    args = parser.parse_args(argv)
    with open(args.spec) as f:
        spec = spec_class.from_json(f.read())
    smoke = getattr(spec, "smoke", False)
    if smoke:
        os.environ.update(SMOKE_ENVIRONMENT)
    result = measure_fn(contenders[args.contender], spec, args.result, record=not _launched_by_lightning_ddp())
    if result is not None:
        write_whole(args.result, result, indent=1)
    if smoke:
        _leave_now()


def _leave_now() -> None:
    """Exit at once, without the interpreter's and Ray's orderly shutdown (2-3 s on 2 busy cores, after the
    measurement): the result is written, the harness kills what is left of the process group, and Ray ends the
    job's workers as after any exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
