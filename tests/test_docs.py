"""The documentation cannot drift from the code: the site builds strictly, and every Python block on it runs.

A block runs unless the line before it is ``<!-- not run: why -->`` (a GPU cluster, a bucket, a Ray Client
server); those are still compiled. A page's blocks run in order in one namespace, as a reader pastes them,
seeded with what the pages call the reader's own code: ``pl``, ``MyLightningModule``/``MyModule`` (a small
regressor) and ``model``. A page that imports ``lightning`` gets a ``model`` of that package.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: (?P<why>.+?) -->\s*$")


def python_blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """(line, code, why it is not run or None) of each Python block of a page."""
    text = page.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        if match.group("lang") != "python":
            continue
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        not_run = NOT_RUN.search(before)
        code = textwrap.dedent(match.group("body"))
        blocks.append((text.count("\n", 0, match.start()) + 1, code, not_run.group("why") if not_run else None))
    return blocks


def _page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


# README.md's script is docs/index.md's: one run of it is enough.
RUNNABLE = [p for p in PAGES if p.name != "index.md" and any(why is None for _, _, why in python_blocks(p))]


def test_every_block_compiles_and_a_skipped_one_says_why():
    blocks = [(page, *block) for page in PAGES for block in python_blocks(page)]
    assert len(blocks) > 10, "the pages' Python blocks were not found"
    for page, line, code, why in blocks:
        compile(code, f"{_page_id(page)}:{line}", "exec")
        assert why is None or len(why) > 10, f"{_page_id(page)}:{line}: say why the block is not run"


def _seed(page_text: str) -> dict:
    """The reader's own code the pages name: a small regressor of the page's Lightning package, with its data."""
    from tests.test_namespaces import data, make_module

    package = "lightning.pytorch" if "import lightning as L" in page_text else "pytorch_lightning"
    pl_of_page = importlib.import_module(package)

    class MyLightningModule(make_module(pl_of_page)):
        def train_dataloader(self):
            return data()

        def val_dataloader(self):
            return data()

        def predict_dataloader(self):
            return data()

    return {
        "__name__": "__docs__",
        "pl": pl_of_page,
        "MyLightningModule": MyLightningModule,
        "MyModule": MyLightningModule,
        "model": MyLightningModule(),
    }


@pytest.mark.parametrize("page", RUNNABLE, ids=_page_id)
def test_the_pages_python_runs(page, ray_local, no_waiting_workers):
    namespace = _seed(page.read_text(encoding="utf-8"))
    before = {k: v.clone() for k, v in namespace["model"].state_dict().items()}
    ran = [(line, code) for line, code, why in python_blocks(page) if why is None]
    for line, code in ran:
        exec(compile(code, f"{_page_id(page)}:{line}", "exec"), namespace)
    if any("trainer.fit(model)" in code for _, code in ran):
        # What the pages promise: training ran in the workers and the trained weights are in `model`.
        after = namespace["model"].state_dict()
        assert any(not after[k].equal(v) for k, v in before.items()), "model's weights did not come back"


def test_the_site_builds_strictly(tmp_path):
    """`python3 dev.py docs`: a broken link, anchor or API reference fails the build."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    reference = (tmp_path / "site" / "reference" / "index.html").read_text(encoding="utf-8")
    # The reference is generated from the docstrings: RayStrategy's arguments are on it.
    assert "placement_timeout_s" in reference and "RayDataModule" in reference
    for page in ("getting-started", "tune", "benchmarks", "CHANGELOG", "how-it-works"):
        assert (tmp_path / "site" / page / "index.html").exists(), page
