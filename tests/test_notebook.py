"""A real Jupyter kernel: a module defined in the notebook trains twice, then tests, with RayAccelerator."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

CELLS = [
    # The kernel starts its own local Ray, as a user's notebook would.
    f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})",
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


def test_fit_twice_and_test_in_a_jupyter_kernel(tmp_path):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in CELLS])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    try:
        client.execute()
    except Exception as error:  # show the failing cell's output
        pytest.fail(f"notebook failed: {error}")
    outputs = "".join(o.get("text", "") for o in notebook.cells[-1].outputs if o.get("output_type") == "stream")
    assert "LOSSES" in outputs
