"""examples/hydra_app.py as a user runs it: one run and a sweep, each job exactly once, in its own directory."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.subprocess_util import explain, run_example

# Small enough for a 2-core machine; still real DDP between 2 Ray workers.
TINY_TRAINER = ("trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=2")
TINY = (*TINY_TRAINER, "strategy.num_workers=2")
START = re.compile(r"^hydra_app: job starts in (\S+) \(pid (\d+)\)$", re.MULTILINE)


def _check_job_outputs(job_dir: Path) -> dict:
    """The job's results file, Lightning logs and checkpoint all lie inside its Hydra directory."""
    results = json.loads((job_dir / "metrics.json").read_text())
    assert 0.0 <= results["metrics"]["val_acc"] <= 1.0, results
    assert results["epochs"] == 1 and results["global_step"] == 4, results
    best = Path(results["best_checkpoint"])
    assert best.is_file() and best.is_relative_to(job_dir), results
    assert Path(results["log_dir"]).is_relative_to(job_dir / "lightning_logs"), results
    assert (job_dir / ".hydra" / "config.yaml").is_file()
    return results


@pytest.mark.timeout(480)
def test_single_run_writes_into_its_run_dir_and_runs_once(tmp_path):
    run_dir = tmp_path / "run"
    args = (f"hydra.run.dir={run_dir}", "model.lr=0.02", *TINY)
    result = run_example("hydra_app.py", *args, cwd=tmp_path, timeout_s=420)
    assert result.returncode == 0, explain(result)

    # Lightning's ddp would re-run sys.argv for rank 1: a second start line, in a directory of its own.
    assert [d for d, _ in START.findall(result.stdout)] == [str(run_dir)], explain(result)
    assert "2 worker(s)" in result.stdout, explain(result)
    results = _check_job_outputs(run_dir)
    assert results["config"]["model"]["lr"] == 0.02
    # Nothing outside the run directory: Hydra did not change directory and Lightning followed default_root_dir.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.timeout(600)
def test_multirun_sweep_runs_each_job_once_in_its_own_dir(tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = run_example(
        "hydra_app.py", "-m", f"hydra.sweep.dir={sweep_dir}", "model.lr=0.01,0.05", *TINY, cwd=tmp_path, timeout_s=540
    )
    assert result.returncode == 0, explain(result)

    starts = START.findall(result.stdout)
    # Exactly one start per job, all in this one process: the sweep was not re-run by any worker.
    assert [d for d, _ in starts] == [str(sweep_dir / "0"), str(sweep_dir / "1")], explain(result)
    assert len({pid for _, pid in starts}) == 1, explain(result)
    assert result.stdout.count("Launching 2 jobs locally") == 1, explain(result)
    lrs = [_check_job_outputs(sweep_dir / job)["config"]["model"]["lr"] for job in ("0", "1")]
    assert lrs == [0.01, 0.05]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]


@pytest.mark.timeout(300)
def test_the_once_check_catches_lightnings_ddp_relaunch(tmp_path):
    """The control for the checks above: Lightning's own ddp (on 2 CPU processes) re-runs the script for rank 1."""
    run_dir = tmp_path / "run"
    ddp = (
        "strategy._target_=pytorch_lightning.strategies.DDPStrategy",
        "+trainer.accelerator=cpu",
        "+trainer.devices=2",
    )
    no_ray_args = ("~strategy.num_workers", "~strategy.num_cpus_per_worker", "~strategy.use_gpu")
    result = run_example(
        "hydra_app.py", f"hydra.run.dir={run_dir}", *TINY_TRAINER, *ddp, *no_ray_args, cwd=tmp_path, timeout_s=240
    )
    assert result.returncode == 0, explain(result)
    starts = START.findall(result.stdout)
    assert len(starts) == 2 and len({pid for _, pid in starts}) == 2, explain(result)
