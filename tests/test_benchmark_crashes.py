"""The benchmark harness measures a contender again after its driver crashed, once, and says so in the report.

A real driver process (``python -m`` a module written here) is killed by a real signal; no Ray is needed.
"""

from __future__ import annotations

import textwrap

import pytest

from benchmarks.drivers import MeasurementCrashed, _measure_or_again, measure_once
from benchmarks.report import failure_lines

# A driver as the harness starts one: it writes its result where --result says. It counts its starts in a file and,
# for the first CRASHES of them, dies as a crashed process does (SIGABRT), for the first HANGS never finishes, or,
# with FAIL set, raises.
_DRIVER = """
import argparse, json, os, signal, sys
parser = argparse.ArgumentParser()
for name in ("--contender", "--spec", "--result"):
    parser.add_argument(name)
args = parser.parse_args()
starts = os.path.join(os.path.dirname(__file__), "starts")
with open(starts, "a") as f:
    f.write("x")
started = len(open(starts).read())
if os.environ.get("FAIL"):
    raise SystemExit("the measured code failed")
if started <= int(os.environ["CRASHES"]):
    os.kill(os.getpid(), signal.SIGABRT)
if started <= int(os.environ.get("HANGS", "0")):
    signal.pause()  # a driver that never finishes (a contender's trial that stopped reporting)
with open(args.result, "w") as f:
    json.dump({"contender": args.contender, "metrics": {"started": started}}, f)
"""


def _measure(tmp_path, timeout_s: float = 60, **env: str):
    (tmp_path / "crashing_driver.py").write_text(textwrap.dedent(_DRIVER))
    (tmp_path / "logs").mkdir()
    env = {"PYTHONPATH": str(tmp_path), "CRASHES": "0", **env}

    def run(result_path: str, log_path: str):
        return measure_once("ddp_spawn", "spec.json", result_path, log_path, env, timeout_s, entry="crashing_driver")

    return _measure_or_again("ddp_spawn", 0, str(tmp_path), tmp_path / "logs", run)


def _starts(tmp_path) -> int:
    return len((tmp_path / "starts").read_text())


def test_a_crashed_measurement_is_measured_again_and_the_report_says_so(tmp_path):
    result = _measure(tmp_path, CRASHES="1")

    assert result["metrics"] == {"started": 2}
    assert "exited with -6" in result["crashed_before"]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["ddp_spawn-0-again.log", "ddp_spawn-0.log"]
    document = {"errors": [], "measurements": [{**result, "repeat": 0}]}
    assert failure_lines(document) == [
        "",
        "Measured again after a crash or hang (the JSON has the end of the log):",
        "- ddp_spawn, repeat 1: the ddp_spawn driver process exited with -6; end of "
        f"{tmp_path / 'logs' / 'ddp_spawn-0.log'}:",
    ]


def test_a_driver_that_does_not_finish_is_measured_again(tmp_path):
    result = _measure(tmp_path, timeout_s=10, HANGS="1")

    assert result["metrics"] == {"started": 2}
    assert "did not finish within 10 s" in result["crashed_before"]


def test_a_second_crash_is_a_failed_measurement(tmp_path):
    with pytest.raises(MeasurementCrashed, match="exited with -6"):
        _measure(tmp_path, CRASHES="2")
    assert _starts(tmp_path) == 2


def test_a_measurement_that_fails_without_a_crash_is_not_measured_again(tmp_path):
    with pytest.raises(RuntimeError, match="exited with 1") as failure:
        _measure(tmp_path, FAIL="1")
    assert not isinstance(failure.value, MeasurementCrashed)
    assert "the measured code failed" in str(failure.value)
    assert _starts(tmp_path) == 1
    error = {"contender": "ddp_spawn", "repeat": 0, "error": str(failure.value)}
    assert failure_lines({"errors": [error], "measurements": []})[1].startswith("Failed measurements")


@pytest.mark.parametrize(
    "last_words",
    [
        # ddp_spawn's driver exits with 1 when one of its ranks died of a signal; torch's spawn names the signal.
        "torch.multiprocessing.spawn.ProcessExitedException: process 0 terminated with signal SIGABRT",
        # Another process took the port Lightning picked for the rendezvous before torch's store bound it.
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
        "port: 52241, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use",
    ],
)
def test_a_rank_killed_under_torch_spawn_or_a_port_taken_counts_as_a_crash(tmp_path, last_words):
    (tmp_path / "crashing_driver.py").write_text(f"raise SystemExit({last_words!r})\n")
    (tmp_path / "logs").mkdir()
    env = {"PYTHONPATH": str(tmp_path)}
    with pytest.raises(MeasurementCrashed, match="exited with 1"):
        measure_once("ddp_spawn", "spec.json", str(tmp_path / "r.json"), str(tmp_path / "logs" / "l.log"), env, 60,
                     entry="crashing_driver")  # fmt: skip
    assert not (tmp_path / "r.json").exists()
