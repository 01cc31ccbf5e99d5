"""The fallback stack dump (faulthandler on SIGUSR1) works, and leaves no file behind, SIGKILL included.

Workers once left an empty ``/tmp/ray_lightning-stack-<pid>.txt`` each (670 after one run of the
suite). Now, on Linux, the dump goes to an anonymous file the kernel frees with the process; the
named file (other systems) is removed at exit, or, for a killed worker, by the next clean-up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import ray

from ray_lightning.launch import stacks
from ray_lightning.launch.actor import RayWorker
from tests.conftest import ROOT, wait_for

# A worker-like process: registers the dump, says so, and blocks in a function of its own until stdin closes.
WORKER = """
import os, sys
from ray_lightning.launch import stacks
{setup}
stacks.enable_signal_dump()

def blocked_in_the_worker():
    print("ready", flush=True)
    sys.stdin.readline()

blocked_in_the_worker()
"""


def _start_worker(setup: str = "") -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", WORKER.format(setup=setup)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert process.stdout.readline().strip() == "ready", "the worker-like process did not start"
    return process


def _kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def _signal_dump_only(monkeypatch) -> None:
    """Take stacks as where py-spy may not attach."""
    monkeypatch.setattr(stacks, "_py_spy", lambda pid: None)


@pytest.mark.skipif(not stacks._ANONYMOUS, reason="anonymous dump files need Linux (memfd_create, /proc)")
def test_a_worker_writes_its_stack_without_a_file_and_a_killed_one_leaves_none(monkeypatch):
    _signal_dump_only(monkeypatch)
    process = _start_worker()
    try:
        path = stacks._dump_path(process.pid)
        assert not os.path.exists(path), path
        stack = stacks.stack_of(process.pid)
        assert "blocked_in_the_worker" in stack, stack
        assert "blocked_in_the_worker" in stacks.stack_of(process.pid), "a second dump"
        _kill(process)
        assert not os.path.exists(path), path
        assert stacks.stack_of(process.pid).startswith("(no stack"), "a dead process is not signalled"
    finally:
        process.kill()


# Without anonymous files: another system, or a sandbox that refuses them (the reader looks for both).
WITHOUT_MEMFD = {
    "no memfd": "stacks._ANONYMOUS = False",
    "memfd refused": "def refuse(*args):\n    raise PermissionError(1, 'refused by seccomp')\nos.memfd_create = refuse",
}


@pytest.mark.parametrize("setup", WITHOUT_MEMFD.values(), ids=WITHOUT_MEMFD.keys())
def test_a_named_dump_file_is_removed_at_exit_and_after_a_kill(monkeypatch, setup):
    """Where anonymous files are not available: the file is there while the worker lives, and only then."""
    _signal_dump_only(monkeypatch)
    if "_ANONYMOUS" in setup:
        monkeypatch.setattr(stacks, "_ANONYMOUS", False)
    ends_normally, killed = _start_worker(setup), _start_worker(setup)
    try:
        for process in (ends_normally, killed):
            assert os.path.exists(stacks._dump_path(process.pid))
            assert "blocked_in_the_worker" in stacks.stack_of(process.pid)
        ends_normally.communicate("\n", timeout=30)  # returns from its function and exits
        assert ends_normally.returncode == 0
        assert not os.path.exists(stacks._dump_path(ends_normally.pid)), "left by a worker that exited"
        _kill(killed)
        assert os.path.exists(stacks._dump_path(killed.pid))  # a killed process removes nothing itself
        stacks.remove_dead_dumps()  # what the next worker, or the next stack taken, on the machine does
        assert not os.path.exists(stacks._dump_path(killed.pid)), "left by a killed worker"
    finally:
        for process in (ends_normally, killed):
            process.kill()


def test_leftover_files_of_dead_processes_are_removed_and_live_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(stacks.tempfile, "gettempdir", lambda: str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid in (dead.pid, os.getpid()):
        open(stacks._dump_path(pid), "w").close()
    other = tmp_path / "ray_lightning-stack-notapid.txt"
    other.write_text("")
    stacks.remove_dead_dumps()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"ray_lightning-stack-{os.getpid()}.txt", other.name])


@pytest.mark.usefixtures("ray_local")
def test_a_real_worker_actor_gives_its_stack_by_the_fallback_and_leaves_no_file_when_killed():
    actor = ray.remote(RayWorker).options(num_cpus=0).remote(0)
    info = ray.get(actor.node_info.remote(), timeout=120)
    path = stacks._dump_path(info.pid)
    try:
        # As the stack task does where py-spy cannot attach: in another process of the node.
        stack = ray.get(ray.remote(num_cpus=0)(stacks._signal_dump).remote(info.pid), timeout=120)
        assert stack and "(most recent call first)" in stack and "File " in stack, stack
        assert not os.path.exists(path) or not stacks._ANONYMOUS, path
        os.kill(info.pid, signal.SIGKILL)
        wait_for(lambda: not _alive(info.pid), 30, f"the killed worker (pid {info.pid}) to be gone")
        stacks.remove_dead_dumps()
        assert not os.path.exists(path), path
    finally:
        ray.kill(actor)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    time.sleep(0.1)
    return True
