"""Real Jupyter kernels: a module defined in a notebook, and examples/train_digits_notebook.ipynb as a user runs it."""

from __future__ import annotations

import importlib.util
import math
import re
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.subprocess_util import EXAMPLES, ROOT, example_env

EXAMPLE_NOTEBOOK = EXAMPLES / "train_digits_notebook.ipynb"

CELLS = [
    # The kernel starts its own local Ray, as a user's notebook would.
    f"import sys; sys.path.insert(0, {str(ROOT)!r})",
    """
import pytorch_lightning as pl, torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from ray_lightning import RayAccelerator

class NotebookModel(pl.LightningModule):   # defined in the notebook: shipped to workers by value
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("loss", loss)
        return loss
    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self.layer(x), y), sync_dist=True)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

g = torch.Generator().manual_seed(0)
x = torch.randn(64, 4, generator=g); y = x.sum(1, keepdim=True)
loader = DataLoader(TensorDataset(x, y), batch_size=8)
model = NotebookModel()
""",
    """
losses = []
for _ in range(2):
    trainer = pl.Trainer(max_epochs=2, accelerator=RayAccelerator(num_workers=2), logger=False,
                         enable_progress_bar=False, enable_checkpointing=False)
    trainer.fit(model, loader)
    losses.append(trainer.test(model, loader)[0]["test_loss"])
print("LOSSES", losses)
assert losses[1] < losses[0], losses
""",
]


def _execute(notebook: nbformat.NotebookNode, cwd: Path) -> None:
    """Run every cell in a fresh python3 kernel started in ``cwd``; fail with the failing cell's error."""
    client = NotebookClient(notebook, timeout=450, kernel_name="python3", resources={"metadata": {"path": str(cwd)}})
    try:
        client.execute(env=example_env())
    except Exception as error:  # noqa: BLE001 - any failure of a cell fails the test, with its text
        pytest.fail(f"notebook failed: {error}")


def _stream_text(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")


@pytest.fixture(scope="module")
def own_notebook(tmp_path_factory) -> nbformat.NotebookNode:
    """CELLS, SHARDED_CELLS, then FABRIC_CELLS, run in one kernel: a kernel and its local Ray start once, as in a
    user's session that goes on from one model to the next; each test checks the output of its own cells."""
    sources = CELLS + SHARDED_CELLS[1:] + FABRIC_CELLS  # the first two begin with the same sys.path cell
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in sources])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    _execute(notebook, tmp_path_factory.mktemp("notebook"))
    return notebook


@pytest.mark.timeout(900)
def test_fit_twice_and_test_in_a_jupyter_kernel(own_notebook):
    assert "LOSSES" in _stream_text(own_notebook.cells[len(CELLS) - 1])


def test_example_notebook_is_stored_without_outputs():
    notebook = nbformat.read(EXAMPLE_NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code_cells = [c for c in notebook.cells if c.cell_type == "code"]
    assert code_cells and all(not c.outputs and c.execution_count is None for c in code_cells)


@pytest.mark.timeout(900)
def test_example_notebook_fits_twice_on_two_workers():
    notebook = nbformat.read(EXAMPLE_NOTEBOOK, as_version=4)
    # From examples/, as a user opening the notebook there: `from train_digits import ...` finds the file.
    _execute(notebook, EXAMPLES)
    text = "\n".join(_stream_text(cell) for cell in notebook.cells if cell.cell_type == "code")
    root_dir = Path(re.search(r"^logs and checkpoints in (\S+)$", text, re.M)[1])
    try:
        assert "ray_lightning: 2 worker(s)" in text
        # The metrics that came back, as each fit's cell displays them.
        shown = [o.data["text/plain"] for c in notebook.cells for o in c.get("outputs", ()) if "data" in o]
        assert len([s for s in shown if "'val_acc': tensor(" in s and "'val_loss': tensor(" in s]) == 2, shown

        rows = {
            name: (int(epochs), int(steps), float(loss), float(acc))
            for name, epochs, steps, loss, acc in re.findall(
                r"^(fit \d)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", text, re.M
            )
        }
        assert set(rows) == {"fit 1", "fit 2"}, text
        # 1400 training samples split between 2 workers, batches of 64: 11 optimizer steps per epoch.
        steps_per_epoch = math.ceil(1400 / 2 / 64)
        assert rows["fit 1"][:2] == (2, 2 * steps_per_epoch), rows
        # The second fit resumed at epoch 2 instead of starting over.
        assert rows["fit 2"][:2] == (5, 5 * steps_per_epoch), rows
        assert rows["fit 2"][2] < rows["fit 1"][2] and rows["fit 2"][3] > 0.8, rows

        best = Path(re.search(r"^best checkpoint: (\S+)$", text, re.M)[1])
        assert best.is_file() and best.is_relative_to(root_dir), best
        assert "reloaded: DigitsClassifier" in text
    finally:
        shutil.rmtree(root_dir, ignore_errors=True)


SHARDED_CELLS = [
    f"import sys; sys.path.insert(0, {str(ROOT)!r})",
    """
import importlib.util
import pytorch_lightning as pl, torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
import ray_lightning

class Net(pl.LightningModule):   # defined in the notebook: shipped to the workers by value
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    def forward(self, x):
        return self.net(x)
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class ShardsItself(Net):   # for RayModelParallelStrategy: the module applies FSDP2 on the mesh itself
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

g = torch.Generator().manual_seed(0)
x = torch.randn(64, 4, generator=g); y = x.sum(1, keepdim=True)
loader = DataLoader(TensorDataset(x, y), batch_size=8)
""",
    """
strategies = {
    "fsdp": (ray_lightning.RayFSDPStrategy(num_workers=2, auto_wrap_policy={nn.Linear}), Net),
    "model_parallel": (ray_lightning.RayModelParallelStrategy(num_workers=2), ShardsItself),
}
if importlib.util.find_spec("deepspeed") is not None:
    strategies["deepspeed"] = (ray_lightning.RayDeepSpeedStrategy(num_workers=2, stage=3), Net)
for name, (strategy, cls) in strategies.items():
    pl.seed_everything(0)
    model = cls()
    before = model.net[0].weight.detach().clone()
    trainer = pl.Trainer(max_epochs=2, strategy=strategy, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False)
    trainer.fit(model, loader)
    assert not torch.equal(before, model.net[0].weight), name
    print("TRAINED", name, type(model.net[0].weight).__name__)
""",
]


@pytest.mark.timeout(900)
def test_sharded_strategies_train_in_a_jupyter_kernel(own_notebook):
    text = _stream_text(own_notebook.cells[len(CELLS) + len(SHARDED_CELLS) - 2])
    # The weights came home as plain tensors into the notebook's own module.
    assert "TRAINED fsdp Parameter" in text and "TRAINED model_parallel Parameter" in text, text
    if importlib.util.find_spec("deepspeed") is not None:
        assert "TRAINED deepspeed Parameter" in text, text


# Fabric in the same kernel: a loop defined in the notebook, launched twice (the second on the warm workers).
FABRIC_CELLS = [
    """
import os
import lightning as L
from ray_lightning import RayStrategy

def notebook_loop(fabric, steps):   # defined in the notebook: shipped to the workers by value
    fabric.seed_everything(0)
    model = nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = fabric.setup_dataloaders(loader)
    for _, (xb, yb) in zip(range(steps), data):
        loss = F.mse_loss(model(xb), yb)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return {"loss": fabric.all_reduce(loss.detach()).item(), "pid": os.getpid(), "world": fabric.world_size}

runs = [L.Fabric(strategy=RayStrategy(num_workers=2)).launch(notebook_loop, steps) for steps in (1, 4)]
assert runs[0]["pid"] == runs[1]["pid"], runs   # the second launch ran on the workers the first left waiting
assert runs[1]["loss"] < runs[0]["loss"] and runs[1]["world"] == 2, runs
print("FABRIC", runs)
""",
]


@pytest.mark.timeout(900)
def test_fabric_launches_twice_in_a_jupyter_kernel(own_notebook):
    assert "FABRIC [" in _stream_text(own_notebook.cells[-1])
