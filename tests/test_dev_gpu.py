"""`python3 dev.py gpu` (dev_gpu.py) where there is no GPU: it says so at once, and its report is right.

No Ray starts here. Where a test needs a machine "with CUDA" it fakes the facts that dev_gpu found and hides
the real GPUs (CUDA_VISIBLE_DEVICES="") from the processes it starts, so it checks the same thing on any machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import dev_gpu
from tests.conftest import ROOT

_CUDA_MACHINE = {
    "python": "3.12.3",
    "executable": "/usr/bin/python3",
    "cuda_available": True,
    "torch": "2.11.0+cu128",
    "torch_cuda": "12.8",
    "devices": [{"name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_gib": 79.2}],
    "nvidia_smi": "0, NVIDIA H100 80GB HBM3, 81559 MiB, 570.86.15",
    "cudnn": 91002,
    "nccl": "2.27.3",
    "bf16": True,
    "checkout": "abc1234",
}

_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="5" time="12.5">
<testcase classname="tests.test_gpu" name="test_one_gpu_worker_trains_on_cuda_with_nccl" time="7.25" />
<testcase classname="tests.test_gpu" name="test_bf16_mixed_precision_on_the_gpu_worker" time="3.5">
<failure message="AssertionError: assert 'cpu' == 'cuda:0' | see below">tests/test_gpu.py:99: in test_bf16
    assert start["device"] == "cuda:0"
E   AssertionError: assert 'cpu' == 'cuda:0'</failure></testcase>
<testcase classname="tests.test_gpu" name="test_a_tune_trial_trains_on_the_gpu" time="0.1">
<error message="failed on setup with &quot;RuntimeError: no GPU in the cluster&quot;">RuntimeError: no GPU</error>
</testcase>
<testcase classname="tests.test_gpu" name="test_two_gpu_workers_use_their_own_device" time="0.0">
<skipped type="pytest.skip" message="needs 2 GPUs; this machine has 1">tests/test_gpu.py:80: needs 2 GPUs</skipped>
</testcase>
<testcase classname="tests.test_gpu" name="test_horovod_worker_trains_on_cuda" time="0.0">
<skipped type="pytest.xfail" message="Horovod without NCCL" /></testcase>
</testsuite></testsuites>
"""


def test_without_cuda_it_says_so_and_fails_within_seconds(tmp_path):
    report = tmp_path / "report.md"
    started = time.monotonic()
    # CUDA_VISIBLE_DEVICES="": no GPU for torch even on a machine that has one.
    done = subprocess.run([sys.executable, "dev.py", "gpu", "--out", str(report)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert time.monotonic() - started < 60, "it should stop at the CUDA check"
    text = report.read_text()
    assert "GPU check" in text and ": failed" in text and text in done.stdout
    assert "no CUDA on this machine" in text and "torch.cuda.is_available() is False" in text
    assert "nothing ran" in text and "## Tests" not in text
    # The versions it found, without importing them.
    assert f"| Python | {sys.version.split()[0]} ({sys.executable}) |" in text
    assert "| `torch` | installed (not imported) |" in text and "| `ray_lightning` |" in text


def test_the_report_lists_every_test_with_its_outcome_and_its_reason(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(_JUNIT)
    tests = dev_gpu.junit_results(xml)
    assert [(t.name.split("::")[1], t.outcome) for t in tests] == [
        ("test_one_gpu_worker_trains_on_cuda_with_nccl", "passed"),
        ("test_bf16_mixed_precision_on_the_gpu_worker", "failed"),
        ("test_a_tune_trial_trains_on_the_gpu", "error"),
        ("test_two_gpu_workers_use_their_own_device", "skipped"),
        ("test_horovod_worker_trains_on_cuda", "skipped"),
    ]
    assert tests[0].seconds == 7.25 and tests[0].name == "tests.test_gpu::test_one_gpu_worker_trains_on_cuda_with_nccl"
    assert tests[3].detail == "needs 2 GPUs; this machine has 1"
    assert tests[4].detail == "xfail: Horovod without NCCL"

    run = dev_gpu.Run("python -m pytest tests/test_gpu.py", 1, 12.5, "")
    report = dev_gpu.Report(dev_gpu.datetime.datetime(2026, 11, 25, 19, 0), "python3 dev.py gpu",
                            machine=dict(_CUDA_MACHINE), tests=tests, test_run=run)  # fmt: skip
    text = dev_gpu.render(report)
    assert "5 test(s): 1 passed, 1 failed, 1 error, 2 skipped." in text
    assert "| `tests.test_gpu::test_two_gpu_workers_use_their_own_device` | skipped | 0.0 | needs 2 GPUs" in text
    # A message's pipe does not break the table; the failure's traceback follows it.
    assert "AssertionError: assert 'cpu' == 'cuda:0' \\| see below |" in text
    assert "<details><summary>tests.test_gpu::test_bf16_mixed_precision_on_the_gpu_worker: failed</summary>" in text
    assert "E   AssertionError: assert 'cpu' == 'cuda:0'" in text
    assert 'failed on setup with "RuntimeError: no GPU in the cluster"' in text
    assert "NVIDIA H100 80GB HBM3 (79.2 GiB, compute capability 9.0)" in text
    assert "| CUDA (torch built for) | 12.8 |" in text


def test_imports_are_checked_in_a_child_process_and_failures_named():
    facts = dev_gpu._child("modules", ["json", "no_such_module_here", "dev_gpu"], timeout_s=60)
    assert facts["json"]["ok"] is True
    assert facts["no_such_module_here"] == {
        "ok": False,
        "error": "ModuleNotFoundError: No module named 'no_such_module_here'",
    }
    assert facts["dev_gpu"]["ok"], "the checkout is importable there"


@pytest.fixture
def cuda_machine(monkeypatch):
    """dev_gpu as on a machine with CUDA and everything importable, whose processes see no GPU: the tests skip,
    the benchmarks refuse."""
    monkeypatch.setattr(dev_gpu, "machine_facts", lambda: dict(_CUDA_MACHINE))
    monkeypatch.setattr(
        dev_gpu, "_child", lambda what, names, timeout_s: {n: {"ok": True, "version": "1"} for n in names}
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def test_without_ray_nothing_runs_and_the_report_says_how_to_get_it(cuda_machine, monkeypatch, tmp_path):
    def imports(what, names, timeout_s):
        return {name: {"ok": True, "version": "1"} for name in names} | {
            "ray": {"ok": False, "error": "ModuleNotFoundError: No module named 'ray'"},
            "ray_lightning": {"ok": False, "error": "ModuleNotFoundError: No module named 'ray'"},
        }

    monkeypatch.setattr(dev_gpu, "_child", imports)
    assert dev_gpu.main(["--out", str(tmp_path / "r.md")]) == 1
    text = (tmp_path / "r.md").read_text()
    assert "required module(s) cannot be imported: ray, ray_lightning" in text
    assert "run `bash .gpu/unpack.sh && . /tmp/gpu_env` first" in text
    assert "| `ray` | **missing (required)** | ModuleNotFoundError: No module named 'ray' |" in text
    assert "not run: the tests and the benchmarks" in text and "## Tests" not in text


def test_with_cuda_the_gpu_tests_run_and_every_skip_is_reported_with_its_reason(cuda_machine, tmp_path):
    assert dev_gpu.main(["--no-bench", "--out", str(tmp_path / "r.md")]) == 1
    text = (tmp_path / "r.md").read_text()
    assert "## Tests (tests/test_gpu.py)" in text and "not run: the benchmarks (--no-bench)" in text
    # The processes saw no GPU: every test skipped, saying why, and a run that checked nothing is not a pass.
    assert "`tests.test_gpu::test_one_gpu_worker_trains_on_cuda_with_nccl` | skipped" in text
    assert "| no CUDA GPU on this machine; GPU paths are unit-tested in test_environment.py |" in text
    assert "no test passed: all" in text and "passed" not in text.splitlines()[0]
    assert (tmp_path / "logs" / "r" / "pytest.log").is_file()


def test_the_gpu_benchmarks_refuse_a_machine_without_cuda_and_the_report_says_why(cuda_machine, tmp_path):
    assert dev_gpu.main(["--no-tests", "--tiny", "--out", str(tmp_path / "r.md")]) == 1
    text = (tmp_path / "r.md").read_text()
    assert "benchmarks.step exited with 1" in text and "benchmarks.sharded exited with 1" in text
    assert "benchmarks.step --device gpu needs 1 CUDA GPU(s), one per worker; this machine has 0" in text
    assert "benchmarks.sharded --device gpu needs 1 CUDA GPU(s)" in text
    # Refused before a Ray cluster started or a table was written.
    assert not list(tmp_path.glob("r-*.json"))
