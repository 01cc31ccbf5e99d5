"""Rank 0's progress bar: picked out of its output (real tqdm), drawn by the driver."""

from __future__ import annotations

import io
import sys

import pytest
import pytorch_lightning as pl
from pytorch_lightning.callbacks import TQDMProgressBar
from tqdm import tqdm

from ray_lightning import RayStrategy
from ray_lightning.channel import progress as output
from ray_lightning.channel.progress import ProgressLines, show_progress
from tests.models import BoringModel


def _bar_into(stream, steps: int = 50, leave: bool = True, desc: str = "Epoch 0") -> None:
    with tqdm(total=steps, file=stream, desc=desc, mininterval=0, leave=leave) as bar:
        for _ in range(steps):
            bar.update(1)


def test_redraws_become_a_first_and_a_final_line():
    target = io.StringIO()
    stream = ProgressLines(target, interval_s=3600)
    _bar_into(stream)
    stream.close_line()
    lines = target.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("Epoch 0:   0%") and "0/50" in lines[0]
    assert lines[1].startswith("Epoch 0: 100%") and "50/50" in lines[1]
    assert "\r" not in target.getvalue()


def test_a_nested_bar_keeps_the_outer_bars_last_state():
    target = io.StringIO()
    stream = ProgressLines(target, interval_s=3600)
    outer = tqdm(total=2, file=stream, desc="Epoch 0", mininterval=0)
    outer.update(2)
    _bar_into(stream, steps=4, leave=False, desc="Validation")  # inside the epoch
    outer.set_postfix(val_loss=0.5)
    outer.close()
    stream.close_line()
    lines = target.getvalue().splitlines()
    assert lines[-1].startswith("Epoch 0: 100%") and "val_loss=0.5" in lines[-1], lines
    assert sum(line.startswith("Epoch 0: 100%") for line in lines) <= 2, lines


def test_without_throttling_every_redraw_is_a_line():
    target = io.StringIO()
    stream = ProgressLines(target, interval_s=0)
    _bar_into(stream, steps=5)
    stream.close_line()
    lines = target.getvalue().splitlines()
    assert [line.split("|")[0] for line in lines][-1].startswith("Epoch 0: 100%")
    assert len(lines) >= 5 and all(line.startswith("Epoch 0") for line in lines)


def test_plain_prints_pass_through_and_cursor_moves_are_dropped():
    target = io.StringIO()
    stream = ProgressLines(target, interval_s=3600)
    print("hello from rank 0", file=stream)
    stream.write("\x1b[A\rValidation 3/4\r\x1b[B")
    stream.close_line()
    assert target.getvalue() == "hello from rank 0\nValidation 3/4\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_driver_redraws_one_bar_in_place_on_a_terminal(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    monkeypatch.setattr(output, "_drawn", 0)
    show_progress("Epoch 0:  50%|#####     | 2/4", done=False)
    show_progress("Epoch 0: 100%|##########| 4/4", done=True)
    show_progress("Epoch 1:   0%|", done=False)
    assert terminal.getvalue() == ("\rEpoch 0:  50%|#####     | 2/4\rEpoch 0: 100%|##########| 4/4\n\rEpoch 1:   0%|")


def test_the_driver_writes_lines_where_it_cannot_redraw(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr("sys.stdout", log)
    monkeypatch.setattr(output, "_last_line", float("-inf"))
    show_progress("Epoch 0:  25%|", done=False)
    show_progress("Epoch 0:  50%|", done=False)  # within a second of the last line: skipped
    show_progress("Epoch 0: 100%|", done=True)
    assert log.getvalue() == "Epoch 0:  25%|\nEpoch 0: 100%|\n"


def test_rank_zeros_bar_states_go_to_the_driver(monkeypatch):
    sent = []
    monkeypatch.setattr(output, "send_to_driver", lambda fn, *args: sent.append((fn, args)))
    console = io.StringIO()
    stream = ProgressLines(console, interval_s=3600, to_driver=True)
    print("a plain line", file=stream)
    _bar_into(stream, steps=3)
    stream.close_line()
    assert console.getvalue() == "a plain line\n"  # forwarded by Ray with the rank prefix
    assert [args[1] for _, args in sent] == [False, True]
    assert sent[-1][0] is show_progress and sent[-1][1][0].startswith("Epoch 0: 100%")


@pytest.mark.usefixtures("ray_local")
def test_a_fit_shows_rank_zeros_bar_on_the_drivers_console(capsys):
    # Lightning's default bar is RichProgressBar where `rich` is installed; the driver draws tqdm's.
    trainer = pl.Trainer(
        max_epochs=1,
        strategy=RayStrategy(num_workers=2),
        logger=False,
        enable_checkpointing=False,
        callbacks=[TQDMProgressBar()],
    )
    trainer.fit(BoringModel())
    lines = capsys.readouterr().out.splitlines()
    # Ray prefixes what it forwards from a worker with "(rank N pid=...)"; these come from the driver.
    assert any(line.startswith("Epoch 0: 100%") and "4/4" in line for line in lines), lines


class PrintsManyLines(BoringModel):
    """Prints at the very end of training, on every rank, to stdout and stderr.

    Each rank's lines carry a word of their own: Ray folds lines that differ only in numbers across
    workers into one "[repeated Nx across cluster]" line (RAY_DEDUP_LOGS), which would leave which
    rank's last line shows to chance; here the point is that nothing arrives after fit returns.
    """

    def on_train_end(self):
        name = ("zero", "one")[self.global_rank]
        for i in range(300):
            print(f"worker line rank={self.global_rank} {name} i={i}")
        print(f"worker error line rank={self.global_rank}", file=sys.stderr)


@pytest.mark.usefixtures("ray_local")
def test_every_line_a_worker_printed_arrives_before_fit_returns(capsys):
    trainer = pl.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        strategy=RayStrategy(num_workers=2),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(PrintsManyLines())
    print("DRIVER: fit returned")
    print("DRIVER: fit returned", file=sys.stderr)
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    for rank in (0, 1):
        last = f"rank={rank} {('zero', 'one')[rank]} i=299"
        assert last in out, out[-2000:]
        assert out.index(last) < out.index("DRIVER: fit returned")
        assert err.index(f"worker error line rank={rank}") < err.index("DRIVER: fit returned")
    assert "end-of-call" not in out + err  # the markers themselves are never shown
