"""Every private Lightning name ray_lightning relies on still exists; a failure names what moved.

The names live in ray_lightning._lightning (the one folder allowed to use them, tests/test_layers.py);
when a Lightning release moves one, this is the test that says which, and where it used to be.
"""

from __future__ import annotations

import pytest

from ray_lightning._lightning import PRIVATE_NAMES


@pytest.mark.parametrize("private", PRIVATE_NAMES, ids=lambda p: f"{p.where}.{p.name}")
def test_private_lightning_name_still_exists(private):
    if private.needs is not None:
        pytest.importorskip(private.needs, reason=f"the logger needs {private.needs}, which is not installed")
    missing = private.missing()
    assert missing is None, (
        f"Lightning moved a private name ray_lightning relies on: {missing}. "
        "Update ray_lightning/_lightning/ (the only place that uses it)."
    )


def test_a_moved_name_is_reported(monkeypatch):
    from ray_lightning._lightning import names
    from ray_lightning._lightning.connector import connector_class

    monkeypatch.delattr(connector_class(), "_choose_strategy")
    entry = next(p for p in names.PRIVATE_NAMES if p.name == "_choose_strategy" and "pytorch_lightning" in p.where)
    assert entry.missing() == (
        "pytorch_lightning.trainer.connectors.accelerator_connector._AcceleratorConnector has no _choose_strategy "
        "(no '_choose_strategy' on type)"
    )
