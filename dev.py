#!/usr/bin/env python3
"""The project's two commands, needing only Python 3.10+ to start.

    python3 dev.py example   # train the main example on 2 Ray workers, print the metrics that came back
    python3 dev.py test      # run the whole test suite (extra arguments go to pytest)

Each creates `.venv/` in the checkout on first use, installs what it needs into it, and reuses it
afterwards. torch is installed as the CPU build unless an NVIDIA GPU is visible (`nvidia-smi`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
TORCH_VERSION = "2.13.0"
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
    for old in VENV.glob(".installed-*"):
        old.unlink()
    stamp.touch()


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("example", "test"):
        print(__doc__)
        return 2
    ensure_venv()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if argv[0] == "example":
        cmd = [str(PYTHON), "examples/train_digits.py", *argv[1:]]
    else:
        cmd = [str(PYTHON), "-m", "pytest", *argv[1:]]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
