"""`python3 dev.py matrix`: the smoke tests (tests/test_namespaces.py) on every corner of the version window.

The torch corners (``torch2.4``...) also run the tests their torch enables (``Combination.tests``).

Each combination gets one venv, kept per machine in ``$RAY_LIGHTNING_MATRIX_CACHE`` (default
``~/.cache/ray_lightning/matrix``) and rebuilt only when its requirements change. The checkout is put
on ``PYTHONPATH`` instead of being installed, so one venv serves every clone. Results go into
docs/versions.md between ``<!-- matrix:start -->`` and ``<!-- matrix:end -->``, with the date they were taken.

torch: 2.13.0 is installed from its CPU wheel. A newer torch exists on PyPI only as a CUDA build of
several GB, so it is installed once into ``torch-<version>/`` beside the venvs and shared by them
through a ``.pth`` file. Where this machine's pip configuration caps torch (``/etc/xdg/pip``), the
installs of those venvs run without that configuration (``PIP_CONFIG_FILE=/dev/null``).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import venv
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("RAY_LIGHTNING_MATRIX_CACHE", Path.home() / ".cache" / "ray_lightning" / "matrix"))
SMOKE = "tests/test_namespaces.py"
TEST_REQUIREMENTS = ("pytest>=8", "pytest-timeout", "scikit-learn", "jsonargparse[signatures]>=4.27.7")
CPU_TORCH = "2.13.0"  # the release whose CPU build pip finds (dev.py installs the same)


@dataclass(frozen=True)
class Combination:
    name: str
    torch: str
    ray: str
    lightning: tuple[str, ...]  # the Lightning distributions installed, pinned
    remove: tuple[str, ...] = ()  # uninstalled afterwards
    tests: tuple[str, ...] = (SMOKE,)  # what runs in it

    def requirements(self) -> list[str]:
        return [f"ray[default,tune]=={self.ray}", *self.lightning, *TEST_REQUIREMENTS]

    def digest(self) -> str:
        return hashlib.sha256(json.dumps([self.torch, *self.requirements(), *self.remove]).encode()).hexdigest()[:12]

    @property
    def venv(self) -> Path:
        return CACHE / "venvs" / self.name

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def _corner(label: str, torch: str, ray: str, lightning: str) -> list[Combination]:
    return [
        Combination(f"{label}-pytorch_lightning", torch, ray, (f"pytorch-lightning=={lightning}",)),
        # `lightning` declares a dependency on `pytorch-lightning` (unpinned, so pip brings the newest):
        # removed here, so that only lightning.pytorch can be imported.
        Combination(f"{label}-lightning", torch, ray, (f"lightning=={lightning}",), ("pytorch-lightning",)),
        Combination(f"{label}-both", torch, ray, (f"lightning=={lightning}", f"pytorch-lightning=={lightning}")),
    ]


def _torch_corner(torch: str, ray: str, lightning: str, *more_tests: str) -> Combination:
    both = (f"lightning=={lightning}", f"pytorch-lightning=={lightning}")
    return Combination(f"torch{torch.rsplit('.', 1)[0]}", torch, ray, both, tests=(SMOKE, *more_tests))


# The corners of the window setup.py declares: the oldest and newest of Lightning, Ray and torch,
# each with only `pytorch-lightning`, only `lightning`, and both installed. The oldest has the CPU
# torch dev.py installs, so that `dev.py test` (CI) runs it cheaply. Then the torch releases GPU
# images run (the registry's CUDA builds, which run on CPUs too), with both Lightning packages: 2.4
# (DDP, Tune, the CLI; Horovod where a wheel was built for it) and 2.6 (the sharded strategies refused
# on CPUs: FSDP2 over gloo needs 2.9), then 2.9 and 2.11 with the sharded strategies on CPUs too.
MATRIX = [
    *_corner("oldest", "2.13.0", "2.50.0", "2.4.0"),
    *_corner("newest", "2.15.0", "2.60.0", "2.6.6"),
    _torch_corner("2.4.1", "2.50.0", "2.4.0"),
    _torch_corner("2.6.0", "2.52.1", "2.5.1"),
    _torch_corner("2.9.1", "2.55.1", "2.5.6", "tests/test_sharded.py"),
    _torch_corner("2.11.0", "2.60.0", "2.6.6", "tests/test_sharded.py"),
]
# What `python3 dev.py test` runs after the suite: the oldest corner, in the `lightning` namespace.
MATRIX_IN_TEST = ("oldest-lightning",)


def _pip_env(combo: Combination) -> dict[str, str]:
    env = dict(os.environ)
    if combo.torch != CPU_TORCH:
        env["PIP_CONFIG_FILE"] = os.devnull  # the machine's cap on torch must not pull the shared torch down
    return env


def _pip(python: Path, *args: str, env: dict[str, str] | None = None) -> None:
    cmd = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def _shared_torch(combo: Combination) -> Path:
    target = CACHE / f"torch-{combo.torch}"
    if not target.exists():
        partial = target.with_name(target.name + ".partial")
        print(f"Installing torch {combo.torch} once into {target} (several GB)", flush=True)
        _pip(Path(sys.executable), "--target", str(partial), f"torch=={combo.torch}", env=_pip_env(combo))
        partial.rename(target)
    return target


def ensure(combo: Combination) -> Path:
    """The combination's venv, built or brought up to date."""
    stamp = combo.venv / f".installed-{combo.digest()}"
    if stamp.exists():
        return combo.python
    if combo.venv.exists():
        shutil.rmtree(combo.venv)
    print(f"Creating {combo.venv}", flush=True)
    venv.create(combo.venv, with_pip=True)
    env = _pip_env(combo)
    if combo.torch == CPU_TORCH:
        try:
            _pip(combo.python, f"torch=={combo.torch}+cpu", env=env)
        except subprocess.CalledProcessError:
            _pip(combo.python, f"torch=={combo.torch}", "--index-url", "https://download.pytorch.org/whl/cpu", env=env)
    else:
        site = subprocess.run(
            [str(combo.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        Path(site, "ray_lightning_matrix_torch.pth").write_text(str(_shared_torch(combo)) + "\n")
    _pip(combo.python, *combo.requirements(), env=env)
    if combo.remove:
        subprocess.run([str(combo.python), "-m", "pip", "uninstall", "-y", "-q", *combo.remove], check=True)
    _horovod(combo)
    stamp.touch()
    return combo.python


def _horovod(combo: Combination) -> None:
    """Horovod from dev.py's per-machine wheel cache, where one was built for this torch and Python."""
    wheels = sorted(
        (Path(os.environ.get("RAY_LIGHTNING_WHEEL_CACHE", Path.home() / ".cache/ray_lightning/wheels"))).glob(
            f"horovod-*-torch{combo.torch}*/horovod-*.whl"
        )
    )
    if wheels:
        _pip(combo.python, str(wheels[-1]), env=_pip_env(combo))


def _versions(python: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json\n"
        "out = {}\n"
        "for d in ('torch', 'ray', 'lightning', 'pytorch-lightning', 'horovod'):\n"
        "    try: out[d] = m.version(d)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )
    return json.loads(subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout)


def run(combo: Combination, extra: list[str]) -> dict:
    """Run the smoke tests in the combination's venv; what passed, failed and was skipped."""
    python = ensure(combo)
    report = combo.venv / "junit.xml"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    cmd = [str(python), "-m", "pytest", *combo.tests, "-p", "no:cacheprovider", f"--junitxml={report}", *extra]
    print("+", " ".join(cmd), flush=True)
    code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    outcome: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            kind = (
                "failed"
                if case.find("failure") is not None or case.find("error") is not None
                else ("skipped" if case.find("skipped") is not None else "passed")
            )
            outcome[kind].append(case.get("name", "?"))
    return {"name": combo.name, "code": code, "versions": _versions(python), **outcome}


def _row(result: dict) -> str:
    v = result["versions"]
    lightning = " + ".join(f"{d} {v[d]}" for d in ("lightning", "pytorch-lightning") if d in v)
    failed = ", ".join(result["failed"])
    verdict = "all passed" if result["code"] == 0 and not failed else f"**failed**: {failed or 'see log'}"
    return (
        f"| {result['name']} | {v.get('torch', '?')} | {v.get('ray', '?')} | {lightning} | "
        f"{v.get('horovod', 'not built')} | {len(result['passed'])} passed, {len(result['skipped'])} skipped | "
        f"{verdict} |"
    )


def write_table(results: list[dict]) -> None:
    readme = ROOT / "docs" / "versions.md"
    text = readme.read_text()
    start, end = "<!-- matrix:start -->", "<!-- matrix:end -->"
    if start not in text or end not in text:
        raise SystemExit("docs/versions.md has no matrix markers")
    previous = {
        m.group(1): m.group(0) for m in re.finditer(r"^\| (\S+) \|.*$", text.split(start)[1].split(end)[0], re.M)
    }
    rows = {r["name"]: _row(r) for r in results}
    names = [c.name for c in MATRIX]
    lines = [rows.get(n) or previous.get(n) for n in names]
    table = "\n".join(
        [
            f"Run with `python3 dev.py matrix` on {datetime.date.today().isoformat()} "
            f"(Python {sys.version_info[0]}.{sys.version_info[1]}, Linux x86_64, CPU):",
            "",
            "| combination | torch | Ray | Lightning | Horovod | tests | result |",
            "|---|---|---|---|---|---|---|",
            *(line for line in lines if line),
        ]
    )
    readme.write_text(text.split(start)[0] + start + "\n" + table + "\n" + end + text.split(end)[1])


def main(argv: list[str]) -> int:
    names = [a for a in argv if not a.startswith("-")]
    extra = [a for a in argv if a.startswith("-")]
    unknown = sorted(set(names) - {c.name for c in MATRIX})
    if unknown:
        print(f"unknown combination(s) {unknown}; choose from {[c.name for c in MATRIX]}")
        return 2
    chosen = [c for c in MATRIX if not names or c.name in names]
    results = [run(c, extra) for c in chosen]
    write_table(results)
    for r in results:
        print(_row(r))
    return 0 if all(r["code"] == 0 for r in results) else 1


def run_in_test() -> int:
    """The corners `python3 dev.py test` runs after the suite (no README change)."""
    codes = [run(c, [])["code"] for c in MATRIX if c.name in MATRIX_IN_TEST]
    return max(codes, default=0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
