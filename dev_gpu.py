"""`python3 dev.py gpu`: every GPU test and the GPU rows of the benchmarks, on this machine as it is, in one report.

    python3 dev.py gpu                          # writes benchmarks/results/gpu-<UTC time>.md and prints it
    python3 dev.py gpu --repeats 1 --out r.md   # fewer benchmark repeats, the report elsewhere

It uses the Python that runs it (``sys.executable``) with the torch, Lightning and Ray installed for it: no
venv, no installs, no downloads (a GPU machine may have no package index). What is missing is reported, not
installed. Where Ray is missing, ``bash .gpu/unpack.sh && . /tmp/gpu_env`` puts it on ``PYTHONPATH`` (the
pack that ``bash ../shared/gpu/pack.sh .gpu`` makes where the package index is reachable).

In order: torch and CUDA (without CUDA it stops there, in seconds, exit 1); every module the GPU tests and
benchmarks use, imported in a child process; ``pytest tests/test_gpu.py`` with a JUnit XML file; then
``benchmarks.step --device gpu`` (one worker on the GPU against Lightning's own Trainer on it) and
``benchmarks.sharded --device gpu --workers 1`` (a small model). The report names the device and the
versions, lists every test with its outcome (skips and failures with their reason) and holds the benchmark
tables; the benchmarks' JSON files and every log lie beside it. Exit 0 only where CUDA was there and nothing
failed. Only the standard library is imported here: what the machine lacks cannot stop the report.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
TEST_MODULE = "tests/test_gpu.py"
UNPACK_HINT = "run `bash .gpu/unpack.sh && . /tmp/gpu_env` first"
# (module, what needs it, required): without a required one neither the tests nor the benchmarks can run.
MODULES = (
    ("torch", "everything", True),
    ("pytorch_lightning", "the tests, the benchmarks and ray_lightning", True),
    ("ray", "ray_lightning's workers", True),
    ("pytest", "the tests", True),
    ("typing_extensions", "ray_lightning", True),
    ("numpy", "ray_lightning", True),
    ("psutil", "ray_lightning (Ray ships one)", True),
    ("ray_lightning", "everything (this checkout)", True),
    ("lightning", "the benchmarks' workload uses lightning.pytorch where it is installed", False),
    ("ray.tune", "the GPU Tune trial (fails without it)", False),
    ("pytest_timeout", "pytest.ini's bound per test (without it a hung test is not cut off)", False),
    ("deepspeed", "the DeepSpeed GPU test (skipped without it)", False),
    ("horovod.torch", "the Horovod GPU test (skipped without it)", False),
    ("tensorboardX", "Tune's TensorBoard output (Tune warns without it)", False),
)
# The sharded benchmark on one GPU, small: about 34M parameters (4 blocks 1024 wide).
SHARDED_SIZES = ("--workers", "1", "--blocks", "4")
_TAIL_LINES = 60
_DETAIL_CHARS = 300


@dataclass
class Run:
    """A command's run: its exit code (None: killed at its time bound), duration and the end of its output."""

    command: str
    code: int | None
    seconds: float
    tail: str


@dataclass
class TestResult:
    """One test case of a JUnit XML file; ``detail``: the skip reason or the failure's message."""

    name: str
    outcome: str  # passed, failed, error, skipped
    seconds: float
    detail: str = ""
    text: str = ""  # the failure's traceback


@dataclass
class Report:
    """What ``dev.py gpu`` found, section by section; :func:`render` writes it as markdown."""

    started: datetime.datetime
    command: str
    machine: dict[str, Any] = field(default_factory=dict)
    modules: dict[str, dict[str, Any]] = field(default_factory=dict)
    tests: list[TestResult] = field(default_factory=list)
    test_run: Run | None = None
    benchmarks: list[tuple[str, Run, str | None]] = field(default_factory=list)  # (title, run, its tables)
    not_run: list[str] = field(default_factory=list)  # what was left out, and why
    problems: list[str] = field(default_factory=list)


# -- what this machine has --------------------------------------------------------------------------


def _child_main(what: str, out: str, names: list[str]) -> None:
    """In a child process: write the facts ``what`` (``cuda`` or ``modules``) asks for to ``out`` as JSON."""
    facts = _cuda_facts() if what == "cuda" else _module_facts(names)
    with open(out, "w") as f:
        json.dump(facts, f)


def _cuda_facts() -> dict[str, Any]:
    try:
        import torch
    except BaseException as error:  # noqa: BLE001 - whatever stops torch from importing is the answer
        return {"torch_error": _first_line(error)}
    facts: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    facts["cuda_available"] = available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    facts["devices"] = [
        {
            "name": torch.cuda.get_device_name(i),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
            "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
        }
        for i in range(count)
    ]
    if available:
        facts["cudnn"] = _fact(torch.backends.cudnn.version)
        facts["nccl"] = _fact(torch.cuda.nccl.version) if torch.distributed.is_nccl_available() else None
        facts["bf16"] = _fact(torch.cuda.is_bf16_supported)
    return facts


def _fact(read: Any) -> Any:
    """``read()`` as JSON holds it (a version tuple as ``2.27.3``), or what it raised: one fact lost, not the check."""
    try:
        value = read()
    except Exception as error:  # noqa: BLE001 - reported in its place
        return _first_line(error)
    return ".".join(map(str, value)) if isinstance(value, tuple) else value


def _module_facts(names: list[str]) -> dict[str, dict[str, Any]]:
    facts = {}
    for name in names:
        try:
            module = importlib.import_module(name)
        except BaseException as error:  # noqa: BLE001 - any failure to import (SystemExit too) is what to report
            facts[name] = {"ok": False, "error": _first_line(error)}
            continue
        facts[name] = {"ok": True, "version": getattr(module, "__version__", None) or _installed(name)}
    return facts


def _found_modules() -> dict[str, dict[str, Any]]:
    """Which modules are installed, found without importing any (quick: for a machine where nothing will run)."""
    facts = {}
    for name, _, _ in MODULES:
        found = importlib.util.find_spec(name.split(".")[0]) is not None
        facts[name] = {"ok": found, "imported": False, "version": _installed(name), "error": "not installed"}
    return facts


def _first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return (text[0] if text else type(error).__name__)[:_DETAIL_CHARS]


def _installed(module: str) -> str | None:
    """The installed version of the distribution that provides ``module`` (its top-level name), without importing it."""
    top = module.split(".")[0]
    for distribution in (top, top.replace("_", "-")):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(distribution)
    return None


def _child(what: str, names: list[str], timeout_s: float) -> dict[str, Any]:
    """Run :func:`_child_main` in ``sys.executable`` (imports that crash or hang cannot take this process along)."""
    with tempfile.TemporaryDirectory(prefix="dev-gpu-") as directory:
        out = os.path.join(directory, "facts.json")
        code = f"import dev_gpu, sys; dev_gpu._child_main({what!r}, {out!r}, sys.argv[1:])"
        try:
            done = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True,
                                  timeout=timeout_s)  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"child_error": f"did not answer within {timeout_s:g} s"}
        if done.returncode != 0 or not os.path.isfile(out):
            lines = (done.stderr or done.stdout).strip().splitlines()
            return {"child_error": f"exited with {done.returncode}: {lines[-1] if lines else 'no output'}"}
        with open(out) as f:
            return json.load(f)


def _command_output(*cmd: str) -> str | None:
    """What ``cmd`` prints, or None where it is missing or fails."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def machine_facts() -> dict[str, Any]:
    """This machine, from this process (standard library only) and a child process that imports torch."""
    commit = _command_output("git", "rev-parse", "--short", "HEAD")
    if commit and _command_output("git", "status", "--porcelain"):
        commit += " with uncommitted changes"
    return {
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "nvidia_smi": _command_output(
            "nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"
        ),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
        "checkout": commit or "unknown (no git here)",
        **_child("cuda", [], timeout_s=300),
    }


# -- the tests --------------------------------------------------------------------------------------


def junit_results(path: Path) -> list[TestResult]:
    """Every test case of a pytest JUnit XML file, in file order; a failure wins over an error, an error over a skip."""
    results = []
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        found = {child.tag: child for child in case if child.tag in ("failure", "error", "skipped")}
        outcome = next((tag for tag in ("failure", "error", "skipped") if tag in found), "passed")
        detail, text = "", ""
        if outcome != "passed":
            element = found[outcome]
            detail = element.get("message") or (element.text or "").strip()
            if element.get("type") == "pytest.xfail":
                detail = f"xfail: {detail}"
            text = (element.text or "").strip()
        results.append(
            TestResult(
                name=f"{classname}::{name}" if classname else name,
                outcome={"failure": "failed"}.get(outcome, outcome),
                seconds=float(case.get("time") or 0.0),
                detail=" ".join(detail.split())[:_DETAIL_CHARS],
                text=text,
            )
        )
    return results


def _stream(cmd: list[str], timeout_s: float, log_path: Path) -> Run:
    """Run ``cmd`` in the checkout, its output shown as it comes and kept in ``log_path``; past ``timeout_s`` it is
    killed, with every process it started (its own session)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    started = time.monotonic()
    print("+", " ".join(cmd), flush=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
        )  # fmt: skip

        def pump() -> None:
            for line in process.stdout or ():
                sys.stdout.write(line)
                log.write(line)
                tail.append(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        # Whatever it left running (a Ray it started) ends with it; the session is its own.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        reader.join(timeout=10)
    return Run(" ".join(cmd), code, time.monotonic() - started, "".join(tail))


def run_tests(report: Report, logs: Path, timeout_s: float, select: str | None) -> None:
    """``pytest tests/test_gpu.py`` with a JUnit XML file in a temporary directory; its cases go into ``report``."""
    with tempfile.TemporaryDirectory(prefix="dev-gpu-") as directory:
        xml = Path(directory) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", TEST_MODULE, "-ra", f"--junitxml={xml}", "-o", "junit_family=xunit2"]
        cmd += ["-k", select] if select else []
        report.test_run = run = _stream(cmd, timeout_s, logs / "pytest.log")
        report.tests = junit_results(xml) if xml.is_file() else []
    failed = [t for t in report.tests if t.outcome in ("failed", "error")]
    if run.code is None:
        report.problems.append(f"pytest did not finish within {timeout_s:g} s (killed; its log: {logs / 'pytest.log'})")
    elif failed:
        report.problems.append(f"{len(failed)} test(s) failed: " + ", ".join(t.name.split("::")[-1] for t in failed))
    elif run.code not in (0, 5) or not report.tests:
        report.problems.append(f"pytest exited with {run.code} and reported no failing test (see its output below)")
    elif not any(t.outcome == "passed" for t in report.tests):
        # With CUDA here, a run whose every test skipped checked nothing on the GPU.
        report.problems.append(f"no test passed: all {len(report.tests)} skipped (reasons below)")


# -- the benchmarks ---------------------------------------------------------------------------------


def run_benchmarks(report: Report, out: Path, logs: Path, args: argparse.Namespace) -> None:
    """The GPU rows of the step and sharded benchmarks; their tables (``<report>-step.md``, ...) go into ``report``."""
    stem = out.stem
    common = ["--device", "gpu", "--repeats", str(args.repeats), "--out", str(out.parent), "--timeout", "600"]
    common += ["--tiny"] if args.tiny else []
    runs = (
        ("One worker on the GPU against Lightning's own Trainer on it (benchmarks.step --device gpu)", "step", ()),
        ("Sharded training on one GPU: FSDP2 and FSDP1 against Lightning's own (benchmarks.sharded --device gpu)",
         "sharded", SHARDED_SIZES),
    )  # fmt: skip
    for title, module, sizes in runs:
        name = f"{stem}-{module}"
        cmd = [sys.executable, "-m", f"benchmarks.{module}", *common, *sizes, "--name", name]
        run = _stream(cmd, args.timeout, logs / f"{module}.log")
        tables = out.parent / f"{name}.md"
        report.benchmarks.append((title, run, tables.read_text() if tables.is_file() else None))
        if run.code != 0:
            what = "was killed at its time bound" if run.code is None else f"exited with {run.code}"
            report.problems.append(f"benchmarks.{module} {what}")


# -- the report -------------------------------------------------------------------------------------


def _ended(run: Run) -> str:
    how = "killed at its time bound" if run.code is None else f"exit {run.code}"
    return f"`{run.command}`: {how}, {run.seconds:.0f} s"


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _machine_lines(machine: dict[str, Any]) -> list[str]:
    devices = machine.get("devices") or []
    named = ", ".join(f"{d['name']} ({d['memory_gib']} GiB, compute capability {d['capability']})" for d in devices)
    rows = [
        ("device (torch.cuda.get_device_name)", named or "none: torch sees no CUDA device"),
        ("nvidia-smi", machine.get("nvidia_smi") or "not found, or it failed"),
        ("CUDA_VISIBLE_DEVICES", machine.get("cuda_visible_devices", "unset")),
        ("Python", f"{machine.get('python')} ({machine.get('executable')})"),
        ("torch", machine.get("torch") or machine.get("torch_error") or machine.get("child_error")),
        ("CUDA (torch built for)", machine.get("torch_cuda") or "none (a CPU build)"),
    ]
    if machine.get("cuda_available"):
        rows += [("cuDNN, NCCL", f"{machine.get('cudnn')}, {machine.get('nccl')}"), ("bf16", machine.get("bf16"))]
    rows += [("platform, CPUs", f"{machine.get('platform')}, {machine.get('cpus')}")]
    rows += [("checkout", machine.get("checkout"))]
    return ["| | |", "| --- | --- |", *(f"| {k} | {_cell(v)} |" for k, v in rows)]


def _module_lines(modules: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| module | status | version or error | needed by |", "| --- | --- | --- | --- |"]
    for name, needed_by, required in MODULES:
        fact = modules.get(name)
        if fact is None:
            continue
        found = "importable" if fact.get("imported", True) else "installed (not imported)"
        status = found if fact["ok"] else ("**missing (required)**" if required else "missing")
        detail = fact.get("version") if fact["ok"] else fact.get("error")
        lines.append(f"| `{name}` | {status} | {_cell(detail or '')} | {needed_by} |")
    return lines


def _test_lines(tests: list[TestResult], run: Run | None) -> list[str]:
    counts = collections.Counter(t.outcome for t in tests)
    summary = ", ".join(f"{counts[o]} {o}" for o in ("passed", "failed", "error", "skipped") if counts[o]) or "none"
    head = f"{_ended(run)}; " if run else ""
    lines = [f"{head}{len(tests)} test(s): {summary}.", "", "| test | outcome | s | reason / message |",
             "| --- | --- | ---: | --- |"]  # fmt: skip
    lines += [f"| `{t.name}` | {t.outcome} | {t.seconds:.1f} | {_cell(t.detail)} |" for t in tests]
    for t in (t for t in tests if t.outcome in ("failed", "error")):
        lines += ["", f"<details><summary>{t.name}: {t.outcome}</summary>", "", "```", *t.text.splitlines()[-40:],
                  "```", "</details>"]  # fmt: skip
    if run is not None and (run.code not in (0, 1, 5) or not tests):
        lines += ["", "End of pytest's output:", "", "```", run.tail.rstrip(), "```"]
    return lines


def render(report: Report) -> str:
    """The report as markdown."""
    verdict = "passed" if not report.problems else "failed"
    lines = [
        f"# GPU check, {report.started:%Y-%m-%d %H:%M} UTC: {verdict}",
        "",
        f"`{report.command}`: {TEST_MODULE} and the GPU rows of the step and sharded benchmarks (dev_gpu.py).",
        "",
        *(f"- **{p}**" for p in report.problems),
        *(f"- not run: {n}" for n in report.not_run),
        "",
        "## Machine",
        "",
        *_machine_lines(report.machine),
    ]
    if report.modules:
        lines += ["", "## What this Python has", "", *_module_lines(report.modules)]
        if not report.modules.get("ray", {}).get("ok", True):
            lines += ["", f"Ray is missing: {UNPACK_HINT} (it puts the pack's Ray on PYTHONPATH)."]
    if report.test_run is not None:
        lines += ["", f"## Tests ({TEST_MODULE})", "", *_test_lines(report.tests, report.test_run)]
    for title, run, tables in report.benchmarks:
        lines += ["", f"## {title}", "", f"{_ended(run)}.", ""]
        end = ["No tables were written. End of its output:", "", "```", run.tail.rstrip(), "```"]
        lines += [tables.rstrip()] if tables else end
    return "\n".join(lines).rstrip() + "\n"


def _preflight(report: Report) -> bool:
    """Whether there is CUDA and every required module imports; ``report`` says what is not so."""
    machine = report.machine
    if not machine.get("cuda_available"):
        why = machine.get("torch_error") or machine.get("child_error")
        found = f"the check (torch in {sys.executable}) failed: {why}" if why else (
            f"torch {machine.get('torch')} (built for CUDA {machine.get('torch_cuda')}) sees no GPU: "
            "torch.cuda.is_available() is False"
        )  # fmt: skip
        report.problems.append(f"no CUDA on this machine: {found}. `dev.py gpu` needs an NVIDIA GPU; nothing ran")
        report.modules = _found_modules()
        return False
    report.modules = _child("modules", [name for name, _, _ in MODULES], timeout_s=600)
    if "child_error" in report.modules:
        report.problems.append(f"the imports could not be checked: {report.modules.pop('child_error')}")
        return False
    missing = [name for name, _, required in MODULES if required and not report.modules[name]["ok"]]
    if not missing:
        return True
    hint = f" (Ray is not installed here: {UNPACK_HINT})" if not report.modules["ray"]["ok"] else ""
    report.problems.append(f"required module(s) cannot be imported: {', '.join(missing)}{hint}")
    return False


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dev.py gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--out", default=None, help="the report (default benchmarks/results/gpu-<UTC time>.md)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh driver processes per benchmark contender (3)")
    parser.add_argument("--tiny", action="store_true", help="tiny benchmark sizes: checks the paths, measures nothing")
    parser.add_argument("--no-tests", action="store_true", help="leave the tests out")
    parser.add_argument("--no-bench", action="store_true", help="leave the benchmarks out")
    parser.add_argument("-k", dest="select", default=None, help="only the tests pytest's -k expression selects")
    parser.add_argument("--timeout", type=float, default=1500, help="seconds each of the three runs may take (1500)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    """``dev.py gpu ARGS``: returns the exit code (0: CUDA was there and nothing failed)."""
    args = _parse(argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"gpu-{started:%Y%m%d-%H%M%S}.md"
    out = out.resolve()
    logs = out.parent / "logs" / out.stem
    report = Report(started, " ".join(["python3 dev.py gpu", *argv]), machine=machine_facts())
    if _preflight(report):
        if args.no_tests:
            report.not_run.append("the tests (--no-tests)")
        else:
            run_tests(report, logs, args.timeout, args.select)
        if args.no_bench:
            report.not_run.append("the benchmarks (--no-bench)")
        else:
            run_benchmarks(report, out, logs, args)
    else:
        report.not_run.append("the tests and the benchmarks (see above)")
    text = render(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"Wrote {out}" + (f"; logs in {logs}" if logs.is_dir() else ""), flush=True)
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
