"""Rank 0's progress bar arrives on the driver as readable lines (real tqdm, no Ray needed)."""

from __future__ import annotations

import io

from tqdm import tqdm

from ray_lightning.output import ProgressLines


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
