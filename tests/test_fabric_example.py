"""examples/fabric_digits.py as a user runs it: a Fabric loop on 2 Ray workers, and its restart pattern."""

from __future__ import annotations

import csv
import os

import pytest

from examples import fabric_digits

pytestmark = pytest.mark.usefixtures("ray_local")

RUN = os.path.join("lightning_logs", "fabric_digits", "version_{}")


def test_the_fabric_example_trains_logs_saves_and_reports(capsys):
    result = fabric_digits.main(["--max-epochs", "1"])

    assert result["epochs"] == 1
    assert result["val_acc"] > 3 * fabric_digits.CHANCE
    assert "val_acc = " in capsys.readouterr().out
    # The workers wrote the relative paths in the driver's working directory (the test's tmp_path).
    with open(os.path.join(RUN.format(0), "metrics.csv")) as file:
        rows = list(csv.DictReader(file))
    assert [int(r["epoch"]) for r in rows] == [0]
    assert float(rows[0]["val_acc"]) == pytest.approx(result["val_acc"])
    assert os.path.isfile(os.path.join(RUN.format(0), "last.ckpt"))

    # The next run of the script starts afresh in a directory of its own: it does not resume the last one.
    assert fabric_digits.main(["--max-epochs", "1"])["epochs"] == 1
    assert os.path.isfile(os.path.join(RUN.format(1), "last.ckpt"))


def train_then_die_once(fabric, args, checkpoint):
    """The example's train(), but rank 1's process dies once, right after the first epoch's checkpoint;
    a marker file notes a resume from it (files in the driver's working directory, which the workers share)."""
    save, load = fabric.save, fabric.load

    def save_then_die(path, state):
        save(path, state)
        if fabric.global_rank == 1 and not os.path.exists("died"):
            open("died", "w").close()
            os._exit(1)

    def load_and_note(path, state):
        load(path, state)
        if fabric.global_rank == 0:
            with open("resumed", "a") as file:
                file.write(f"{state['epoch']}\n")

    fabric.save, fabric.load = save_then_die, load_and_note
    return fabric_digits.train(fabric, args, checkpoint)


def test_after_a_worker_dies_the_example_continues_from_its_last_save(monkeypatch, capsys):
    monkeypatch.setattr(fabric_digits, "train", train_then_die_once)
    result = fabric_digits.main(["--max-epochs", "2", "--max-failures", "1"])

    assert os.path.exists("died")
    with open("resumed") as file:
        assert file.read().split() == ["1"], "the second attempt did not load the first one's checkpoint"
    assert result["epochs"] == 2 and result["val_acc"] > 3 * fabric_digits.CHANCE
    assert "restarted after: ray_lightning worker rank 1" in capsys.readouterr().out
