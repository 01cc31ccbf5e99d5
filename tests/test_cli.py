"""examples/cli_digits.py: LightningCLI with ray_lightning's strategies chosen and configured on the command line."""

from __future__ import annotations

import importlib.util
import re

import pytest
import yaml

from tests.subprocess_util import explain, run_example

TINY = ("--trainer.max_epochs=1", "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2")
RAY = ("--trainer.strategy=ray_lightning.RayStrategy", "--trainer.strategy.num_workers=2")
HOROVOD = ("--trainer.strategy=ray_lightning.HorovodRayStrategy", "--trainer.strategy.num_workers=2")
# DDPStrategy arguments that RayStrategy sets itself and refuses from its caller.
RESERVED = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "start_method")

needs_horovod = pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="Horovod is not installed")


def _trained_on_two_workers(output: str, strategy: str) -> None:
    assert "ray_lightning: 2 worker(s)" in output
    summary = re.search(rf"^cli_digits: {strategy} with 2 worker\(s\): epochs=1 .*val_acc=([\d.]+)", output, re.M)
    assert summary and 0.0 <= float(summary[1]) <= 1.0


@pytest.mark.timeout(420)
def test_fit_with_ray_strategy_on_two_workers(tmp_path):
    result = run_example("cli_digits.py", "fit", *RAY, *TINY, cwd=tmp_path, timeout_s=360)
    assert result.returncode == 0, explain(result)
    _trained_on_two_workers(result.stdout, "RayStrategy")
    assert list(tmp_path.glob("lightning_logs/version_0/checkpoints/*.ckpt")), explain(result)


@pytest.mark.timeout(180)
def test_print_config_lists_ray_and_ddp_arguments(tmp_path):
    restarts = ("--trainer.strategy.max_failures=2", "--trainer.strategy.recovery_checkpoint_every_n_steps=50")
    elastic = ("--trainer.strategy.num_workers=[2, 3]", "--trainer.strategy.batch_policy=scale_lr")
    arguments = ("fit", *RAY, *restarts, *elastic, "--print_config")
    result = run_example("cli_digits.py", *arguments, cwd=tmp_path, timeout_s=150, stderr_apart=True)
    assert result.returncode == 0, explain(result)
    strategy = yaml.safe_load(result.stdout)["trainer"]["strategy"]
    assert strategy["class_path"] == "ray_lightning.RayStrategy"
    init_args = strategy["init_args"]
    assert list(init_args["num_workers"]) == [2, 3] and init_args["batch_policy"] == "scale_lr", init_args
    assert init_args["find_unused_parameters"] is False, init_args
    assert (init_args["max_failures"], init_args["recovery_checkpoint_every_n_steps"]) == (2, 50), init_args
    assert init_args["scale_up_timeout_s"] is None, init_args
    assert not set(RESERVED) & set(init_args), init_args


@needs_horovod
@pytest.mark.timeout(480)
def test_horovod_config_printed_then_fit_from_it(tmp_path):
    printed = run_example(
        "cli_digits.py", "fit", *HOROVOD, *TINY, "--print_config", cwd=tmp_path, timeout_s=150, stderr_apart=True
    )
    assert printed.returncode == 0, explain(printed)
    config = yaml.safe_load(printed.stdout)
    assert config["trainer"]["strategy"]["class_path"] == "ray_lightning.HorovodRayStrategy"
    assert config["trainer"]["strategy"]["init_args"]["num_workers"] == 2
    (tmp_path / "digits.yaml").write_text(printed.stdout)

    result = run_example("cli_digits.py", "fit", "--config", "digits.yaml", cwd=tmp_path, timeout_s=360)
    assert result.returncode == 0, explain(result)
    _trained_on_two_workers(result.stdout, "HorovodRayStrategy")


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "strategy",
    [
        "RayStrategy",
        pytest.param("HorovodRayStrategy", marks=needs_horovod),
    ],
)
def test_zero_workers_fails_before_any_worker_starts(tmp_path, strategy):
    args = (f"--trainer.strategy=ray_lightning.{strategy}", "--trainer.strategy.num_workers=0")
    result = run_example("cli_digits.py", "fit", *args, cwd=tmp_path, timeout_s=150)
    assert result.returncode != 0, explain(result)
    # The strategy's own check, while the command line is turned into objects: Ray was never started.
    assert "num_workers must be >= 1, got 0." in result.stdout, explain(result)
    assert "Started a local Ray instance" not in result.stdout, explain(result)
    assert not (tmp_path / "lightning_logs").exists()


# A strategy, and one of its own arguments with a value that is not its default.
SHARDED_ARGUMENTS = {
    "RayFSDPStrategy": ("state_dict_type", "sharded"),
    "RayModelParallelStrategy": ("tensor_parallel_size", 2),
    "RayFSDP1Strategy": ("state_dict_type", "sharded"),
    "RayDeepSpeedStrategy": ("stage", 3),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", list(SHARDED_ARGUMENTS))
def test_sharded_strategies_take_their_arguments_from_the_command_line(tmp_path, strategy):
    if strategy == "RayDeepSpeedStrategy":
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    key, value = SHARDED_ARGUMENTS[strategy]
    args = (f"--trainer.strategy=ray_lightning.{strategy}", "--trainer.strategy.num_workers=2")
    result = run_example("cli_digits.py", "fit", *args, f"--trainer.strategy.{key}={value}", "--print_config",
                         cwd=tmp_path, timeout_s=150, stderr_apart=True)  # fmt: skip
    assert result.returncode == 0, explain(result)
    # DeepSpeed logs to stdout when it finds no GPU ("[<time>] [WARNING] [real_accelerator.py...").
    config = "\n".join(line for line in result.stdout.splitlines() if not re.match(r"\[\d{4}-\d\d-\d\d ", line))
    init_args = yaml.safe_load(config)["trainer"]["strategy"]["init_args"]
    assert init_args["num_workers"] == 2 and init_args["max_failures"] is None, init_args
    assert init_args[key] == value, init_args
