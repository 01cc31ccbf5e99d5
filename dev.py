#!/usr/bin/env python3
"""The project's commands, needing only Python 3.10+ to start.

    python3 dev.py example   # train the main example on 2 Ray workers, print the metrics that came back
    python3 dev.py test      # run the whole test suite (extra arguments go to pytest)
    python3 dev.py test --fast   # the edit loop's tier: units and a few single fits, a few minutes
    python3 dev.py docs      # build the documentation site strictly into site/ (`docs serve`: live, :8000)
    python3 dev.py bench     # run the benchmarks (benchmarks/README.md; extra arguments go to it)
    python3 dev.py bench recovery   # restarts: recovery time against Ray Train, the checkpoints' cost
    python3 dev.py bench sharded    # RayFSDPStrategy against Lightning's own sharded training
    python3 dev.py bench step       # a step of ~8 ms and the first fit: RayStrategy against ddp_spawn
    python3 dev.py bench tune       # a PBT search on Ray Tune: ray_lightning's Tune support against Ray Train v2
    python3 dev.py bench elastic    # a spot node lost and back: elastic RayStrategy against a fixed size and Ray Train
    python3 dev.py matrix    # the smoke tests on every corner of the supported version window (docs/versions.md)
    python3 dev.py gpu       # on a machine with CUDA: every GPU test and the GPU benchmarks, one report

Extra arguments go to the example script or to pytest (`python3 dev.py example --horovod`);
`python3 dev.py example --tune` runs the Ray Tune example (examples/tune_digits.py) instead,
`python3 dev.py example --data` the Ray Data example (examples/ray_data_digits.py), and
`python3 dev.py example --fabric` the Lightning Fabric example (examples/fabric_digits.py).

Each creates `.venv/` in the checkout on first use, installs what it needs into it, and reuses it
afterwards. torch is installed as the CPU build unless an NVIDIA GPU is visible (`nvidia-smi`).

`example --lightning` and `example --tune --lightning` run the examples with `import lightning.pytorch`
instead of `pytorch_lightning` (both are installed in `.venv/`).

`matrix` keeps one venv per combination of the version window (MATRIX below) in
`~/.cache/ray_lightning/matrix/` (per machine, like Horovod's wheel), runs tests/test_namespaces.py in
each with this checkout on PYTHONPATH, and writes the table between the matrix markers of docs/versions.md.
`matrix NAME...` runs only those combinations. `test` ends with the oldest corner (MATRIX_IN_TEST).

`gpu` (dev_gpu.py) creates no venv: it uses the Python that runs dev.py and what is installed for it, with no
installs and no downloads (a GPU machine may have no package index), and reports what is missing (no Ray: run
`bash .gpu/unpack.sh && . /tmp/gpu_env` first). It runs tests/test_gpu.py and the GPU rows of `bench step` and
`bench sharded` and writes one report, benchmarks/results/gpu-<UTC time>.md (`--out`). Without CUDA it says so
and exits 1 at once.

`test` also installs DeepSpeed (built against the venv's torch, `ensure_deepspeed`), and LitGPT for
tests/test_fabric_litgpt.py (`ensure_litgpt`: `pip install --no-deps litgpt==0.5.13 safetensors==0.8.0`; LitGPT's
own pins would downgrade jsonargparse, so it cannot be in setup.py's test extra).

`test` (and `example --horovod`) also installs Horovod (for HorovodRayStrategy). Horovod 0.28.1,
its last release, does not build against torch >= 2.1 as released (it compiles as C++14; torch's
headers need C++17), so this builds its sdist once with that one-line fix and keeps the wheel in a per-machine cache
(`$RAY_LIGHTNING_WHEEL_CACHE`, default `~/.cache/ray_lightning/wheels`): later venvs, clones and
CI runs on the machine install the cached wheel in seconds. The first build takes about 5 minutes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
TORCH_VERSION = "2.13.0"
HOROVOD_VERSION = "0.28.1"
DEEPSPEED_VERSION = "0.19.8"
LITGPT_VERSION = "0.5.13"
SAFETENSORS_VERSION = "0.8.0"  # what LitGPT needs beyond the test extra
WHEEL_CACHE = Path(os.environ.get("RAY_LIGHTNING_WHEEL_CACHE", Path.home() / ".cache" / "ray_lightning" / "wheels"))
# `dev.py bench NAME` runs benchmarks/NAME.py instead of the training-speed benchmark (benchmarks/run.py).
BENCHMARKS = ("data", "elastic", "fabric", "recovery", "sharded", "step", "storage", "tune")
# `dev.py test` alone: the whole suite on two pytest processes (pytest-xdist), each running one test file at a
# time, so a module's fixtures (its cluster of several nodes, the workers its fits share) stay in one process; the
# slowest files are handed out first (tests/conftest.py, SLOWEST_FIRST). Why two: one process left about a quarter
# of two cores idle (Ray's start-ups and waits; the suite took 75 min, on two processes 55), and a third process on
# two cores would only stretch every test's bounded waits. With arguments, one process, as pytest runs.
SUITE_PROCESSES = ("-n", "2", "--dist", "loadfile", "--no-loadscope-reorder")
# Everything whose change means the environment must be brought up to date.
INSTALL_INPUTS = ("setup.py", "dev.py")


def _run(*cmd: str, **kwargs) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, **kwargs)


def _pip(*args: str) -> None:
    _run(str(PYTHON), "-m", "pip", "install", "--disable-pip-version-check", *args)


def _has_cuda() -> bool:
    return (
        shutil.which("nvidia-smi") is not None
        and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    )


def _install_torch() -> None:
    if _has_cuda():
        _pip(f"torch=={TORCH_VERSION}")
        return
    # The CPU build: a local wheel or the registry's `+cpu` build if one is there, else PyTorch's CPU index.
    try:
        _pip(f"torch=={TORCH_VERSION}+cpu")
    except subprocess.CalledProcessError:
        _pip(
            f"torch=={TORCH_VERSION}",
            "--index-url",
            "https://download.pytorch.org/whl/cpu",
            "--extra-index-url",
            "https://pypi.org/simple",
        )


def ensure_venv() -> None:
    digest = hashlib.sha256(b"".join((ROOT / f).read_bytes() for f in INSTALL_INPUTS)).hexdigest()[:16]
    stamp = VENV / f".installed-{digest}"
    if stamp.exists():
        return
    if not PYTHON.exists():
        print(f"Creating {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    probe = subprocess.run(
        [str(PYTHON), "-c", f"import torch; assert torch.__version__.startswith('{TORCH_VERSION}')"],
        capture_output=True,
    )
    if probe.returncode != 0:
        _install_torch()
    _pip("-e", ".[test]")
    for pattern in (".installed-*", ".horovod-*", ".deepspeed-*", ".litgpt-*"):
        for old in VENV.glob(pattern):
            old.unlink()
    stamp.touch()


def _venv_output(code: str) -> str:
    return subprocess.run([str(PYTHON), "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def _horovod_wheel_dir() -> Path:
    # The wheel's compiled extension is tied to the exact torch build and Python it was built against.
    build = _venv_output(
        "import sys, sysconfig, torch; "
        "print(f'torch{torch.__version__}-{sysconfig.get_platform()}-py{sys.version_info[0]}{sys.version_info[1]}')"
    )
    return WHEEL_CACHE / f"horovod-{HOROVOD_VERSION}-{build}".replace("+", "_")


def _build_horovod_wheel(into: Path) -> None:
    print(f"Building Horovod {HOROVOD_VERSION} once for this machine (about 5 minutes); cached in {into}", flush=True)
    with tempfile.TemporaryDirectory(prefix="horovod-build-") as tmp:
        tmp_path = Path(tmp)
        _run(
            str(PYTHON), "-m", "pip", "download", "--disable-pip-version-check", "--no-deps", "--no-binary", ":all:",
            f"horovod=={HOROVOD_VERSION}", "-d", str(tmp_path),
        )  # fmt: skip
        with tarfile.open(next(tmp_path.glob("horovod-*.tar.gz"))) as sdist:
            if hasattr(tarfile, "data_filter"):
                sdist.extractall(tmp_path, filter="data")
            else:  # Python < 3.10.12 has no extraction filters
                sdist.extractall(tmp_path)
        src = tmp_path / f"horovod-{HOROVOD_VERSION}"
        for cmake_file in (src / "CMakeLists.txt", src / "horovod" / "torch" / "CMakeLists.txt"):
            text = cmake_file.read_text()
            if "set(CMAKE_CXX_STANDARD 14)" not in text:
                raise SystemExit(f"{cmake_file} no longer sets C++14; the Horovod build fix needs revisiting")
            cmake_file.write_text(text.replace("set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)"))
        # Build requirements come from the venv itself (--no-build-isolation), so the extension is
        # compiled against the torch that will import it.
        _pip("setuptools", "wheel", "packaging", *([] if shutil.which("cmake") else ["cmake"]))
        env = dict(
            os.environ,
            HOROVOD_WITH_PYTORCH="1",
            HOROVOD_WITH_GLOO="1",
            HOROVOD_WITHOUT_MPI="1",
            HOROVOD_WITHOUT_TENSORFLOW="1",
            HOROVOD_WITHOUT_MXNET="1",
            HOROVOD_CPU_OPERATIONS="gloo",
            MAKEFLAGS=f"-j{os.cpu_count() or 2}",
        )
        if _has_cuda() and shutil.which("nvcc"):
            env["HOROVOD_GPU_OPERATIONS"] = "NCCL"
        built = tmp_path / "wheel"
        _run(
            str(PYTHON), "-m", "pip", "wheel", "--disable-pip-version-check", "--no-build-isolation", "--no-deps",
            "-w", str(built), str(src), env=env,
        )  # fmt: skip
        into.mkdir(parents=True, exist_ok=True)
        for wheel in built.glob("*.whl"):
            # Copy then rename, so a concurrent or interrupted run never sees half a wheel.
            partial = into / (wheel.name + ".partial")
            shutil.copy2(wheel, partial)
            partial.rename(into / wheel.name)


def ensure_horovod() -> None:
    stamp = VENV / f".horovod-{HOROVOD_VERSION}"
    if stamp.exists():
        return
    wheel_dir = _horovod_wheel_dir()
    if not list(wheel_dir.glob("horovod-*.whl")):
        _build_horovod_wheel(wheel_dir)
    _pip(str(next(wheel_dir.glob("horovod-*.whl"))))
    _venv_output("import horovod.torch, horovod.ray")
    stamp.touch()


def ensure_deepspeed() -> None:
    """DeepSpeed (for RayDeepSpeedStrategy's tests), built against the venv's torch: its sdist's build would
    otherwise fetch a torch of its own (several GB of CUDA packages). Its ops are compiled when first used."""
    stamp = VENV / f".deepspeed-{DEEPSPEED_VERSION}"
    if stamp.exists():
        return
    _pip("setuptools", "wheel", "packaging")
    env = dict(os.environ, DS_BUILD_OPS="0")
    _run(
        str(PYTHON), "-m", "pip", "install", "--disable-pip-version-check", "--no-build-isolation",
        f"deepspeed=={DEEPSPEED_VERSION}", env=env,
    )  # fmt: skip
    stamp.touch()


def ensure_litgpt() -> None:
    """LitGPT (a real model for tests/test_fabric_litgpt.py), without its dependencies: its pins would downgrade
    jsonargparse below the test extra's. What it needs beyond the test extra is safetensors."""
    stamp = VENV / f".litgpt-{LITGPT_VERSION}"
    if stamp.exists():
        return
    _pip("--no-deps", f"litgpt=={LITGPT_VERSION}", f"safetensors=={SAFETENSORS_VERSION}")
    _venv_output("from litgpt.model import GPT, Block; from litgpt.config import Config")
    stamp.touch()


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("example", "test", "docs", "bench", "matrix", "gpu"):
        print(__doc__)
        return 2
    if argv[0] == "matrix":
        import dev_matrix

        return dev_matrix.main(argv[1:])
    if argv[0] == "gpu":  # this Python as it is: no venv
        import dev_gpu

        return dev_gpu.main(argv[1:])
    ensure_venv()
    if argv[0] in ("test", "bench") or "--horovod" in argv:
        ensure_horovod()
    if argv[0] == "test":
        ensure_deepspeed()
        ensure_litgpt()
    # NO_MKDOCS_2_WARNING: MkDocs 1.6 prints a banner about MkDocs 2 on every build; mkdocs.yml pins < 2.
    env = dict(os.environ, PYTHONUNBUFFERED="1", NO_MKDOCS_2_WARNING="1")
    if argv[0] == "example" and "--tune" in argv:
        cmd = [str(PYTHON), "examples/tune_digits.py", *(a for a in argv[1:] if a != "--tune")]
    elif argv[0] == "example" and "--data" in argv:
        cmd = [str(PYTHON), "examples/ray_data_digits.py", *(a for a in argv[1:] if a != "--data")]
    elif argv[0] == "example" and "--fabric" in argv:
        cmd = [str(PYTHON), "examples/fabric_digits.py", *(a for a in argv[1:] if a != "--fabric")]
    elif argv[0] == "example":
        cmd = [str(PYTHON), "examples/train_digits.py", *argv[1:]]
    elif argv[0] == "bench" and argv[1:2] and argv[1] in BENCHMARKS:
        cmd = [str(PYTHON), "-m", f"benchmarks.{argv[1]}", *argv[2:]]
    elif argv[0] == "bench":
        cmd = [str(PYTHON), "-m", "benchmarks.run", *argv[1:]]
    elif argv[0] == "docs" and argv[1:2] == ["serve"]:
        cmd = [str(PYTHON), "-m", "mkdocs", "serve", *argv[2:]]
    elif argv[0] == "docs":
        cmd = [str(PYTHON), "-m", "mkdocs", "build", "--strict", *argv[1:]]
    elif "--fast" in argv:  # tests/conftest.py marks the tier
        cmd = [str(PYTHON), "-m", "pytest", "-m", "fast", *(a for a in argv[1:] if a != "--fast")]
    else:  # the whole suite reports its 20 slowest tests (the suite's time is a budget: CI has 90 minutes)
        cmd = [str(PYTHON), "-m", "pytest", *(argv[1:] or [*SUITE_PROCESSES, "--durations=20"])]
    print("+", " ".join(cmd), flush=True)
    code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    if argv[0] == "test" and len(argv) == 1:
        # The whole suite, then the oldest corner of the version window (dev_matrix.MATRIX_IN_TEST).
        import dev_matrix

        code = max(code, dev_matrix.run_in_test())
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
