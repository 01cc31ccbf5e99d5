"""RayDataModule's order and deal (ray_lightning.data.order): pure functions, checked without Ray."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ray_lightning.data.order import (
    Deal,
    DealSpec,
    Intervals,
    Part,
    Rest,
    batches_per_rank,
    epoch_seed,
    shuffled_parts,
    window_least_rows,
    windows,
)


def _parts(sizes):
    return [Part(ref=f"block{i}", offset=0, rows=n, size_bytes=n * 10) for i, n in enumerate(sizes)]


def _order(sizes, window_rows, seed):
    """Every position's (block, row) in the pass's order."""
    out = []
    for window in windows(_parts(sizes), window_rows, seed):
        flat = [(p.ref, r) for p in window.parts for r in range(p.offset, p.offset + p.rows)]
        out += [flat[i] for i in window.rows_in_order()]
    return out


def _read(deal: Deal, rank: int, size: int, total: int, reach=None):
    """A rank's batches as lists of Q positions, as the loader cuts them."""
    batches, k = [], 0
    while True:
        spans = deal.stream(rank, k * size, (k + 1) * size, reach)
        rows = [q for a, b in spans for q in range(a, b)]
        wanted = batches_per_rank(deal.total, deal.spec, rank) if deal.total is not None else None
        if (not rows and (wanted is None or k >= wanted)) or (deal.spec.mode == "drop" and len(rows) < size):
            return batches
        batches.append(rows)
        k += 1


def test_windows_hold_at_least_their_rows_and_skip_empty_blocks():
    # At least 6, 12, 25, 50, 100 rows for windows 0, 1, 2, 3, 4...: the first batch waits for a block or so.
    assert [window_least_rows(k, 100) for k in range(7)] == [6, 12, 24, 48, 96, 100, 100]
    found = list(windows(_parts([1, 0, 6, 300, 5, 0, 0, 7, 2, 30, 40]), 100, None))
    assert [(w.start, w.rows) for w in found] == [(0, 7), (7, 300), (307, 44), (351, 40)]
    assert [len(w.parts) for w in found] == [2, 1, 4, 1], "empty blocks are left out"


def test_the_order_is_a_permutation_within_windows_the_same_for_a_seed_and_new_each_epoch():
    sizes = [64, 1, 500, 3, 200, 64, 64]
    first, again = _order(sizes, 128, 7), _order(sizes, 128, 7)
    assert first == again, "the same seed, the same order"
    assert sorted(first) == sorted(_order(sizes, 128, None)), "every row once"
    assert first != _order(sizes, 128, 8), "another epoch's seed, another order"
    # Rows move only within their window: the first window (64 rows), the second (1 + 500 rows).
    assert {block for block, _ in first[:64]} == {"block0"}
    assert {block for block, _ in first[64:565]} == {"block1", "block2"}
    assert first[:64] != [("block0", r) for r in range(64)], "rows are shuffled"
    assert epoch_seed(3, 0) != epoch_seed(3, 1) and epoch_seed(3, 0) == epoch_seed(3, 0)


def test_a_materialized_datasets_blocks_are_permuted_by_the_seed():
    parts = _parts(range(1, 30))
    assert shuffled_parts(parts, 1) == shuffled_parts(parts, 1)
    assert shuffled_parts(parts, 1) != shuffled_parts(parts, 2) != parts
    assert sorted(p.ref for p in shuffled_parts(parts, 1)) == sorted(p.ref for p in parts)


@pytest.mark.parametrize("mode", ["drop", "pad", "eval"])
def test_the_deal_gives_each_position_once_and_equal_training_batches(mode):
    rng = random.Random(0)
    for _ in range(200):
        world, size, cap = rng.randint(1, 9), rng.randint(1, 40), rng.choice([1, 16, 100, 2048])
        total = rng.randint(0, 3000)
        spec = DealSpec(world, size, cap, mode)
        deal = Deal(spec, total)
        read = [_read(deal, r, size, total) for r in range(world)]
        counts = [len(batches) for batches in read]
        assert counts == [batches_per_rank(total, spec, r) for r in range(world)], (world, size, cap, total)
        seen = [q for batches in read for batch in batches for q in batch]
        assert len(seen) == len(set(seen)) and set(seen) <= set(range(total))
        if mode == "drop":
            assert len(set(counts)) == 1 and counts[0] == total // (world * size), "as many steps as whole steps"
            assert total - len(seen) < world * size + world, "less than a step (and a row per rank) dropped"
        else:
            assert sorted(seen) == list(range(total)), "every position once"
            assert max(counts) - min(counts) <= 1 and (mode == "eval" or len(set(counts)) == 1)


def test_an_unknown_length_is_learned_at_the_tail_and_gives_the_same_deal():
    spec = DealSpec(3, 5, 40, "drop")
    asked = []

    def reach(q):
        asked.append(q)
        return None if q <= 173 else 173

    unknown = Deal(spec)
    assert [_read(unknown, r, 5, 173, reach) for r in range(3)] == [_read(Deal(spec, 173), r, 5, 173) for r in range(3)]
    assert unknown.total == 173 and asked[0] == 15, "the first step needs one batch per rank, no more"


def test_pieces_start_at_one_batch_and_grow_to_the_cap():
    deal = Deal(DealSpec(2, 8, 64, "drop"), 10_000)
    assert [deal.decide(k)[1] for k in range(6)] == [8, 16, 32, 64, 64, 64]
    assert deal.stream(1, 0, 8) == [(8, 16)], "rank 1's first batch is the step's second"


def test_a_resume_on_the_same_world_goes_on_with_the_same_rows_and_on_another_with_the_rest():
    spec = DealSpec(3, 4, 32, "drop")
    deal = Deal(spec, 500)
    whole = [_read(deal, r, 4, 500) for r in range(3)]
    trained = deal.trained(7, Rest(Intervals()))
    assert len(trained) == 7 * 4 * 3
    # The same world size: the deal goes on at batch 7 and gives the same batches as without a stop.
    assert [whole[r][7:] for r in range(3)] == [_read(deal, r, 4, 500)[7:] for r in range(3)]
    # Another world size: the rest, dealt anew; with what was trained, every position of the whole steps once.
    for world in (1, 2, 5):
        rest = Rest(trained)
        n = rest.length(500)
        again = Deal(DealSpec(world, 4, 32, "pad"), n)
        later = [rest.positions(q, q + 1)[0][0] for r in range(world) for b in _read(again, r, 4, n) for q in b]
        assert sorted(later + [p for a, b in trained.spans for p in range(a, b)]) == list(range(500)), world


def test_intervals_and_the_rest_map_positions():
    trained = Intervals([[10, 20], [0, 5], [18, 30], [40, 41]])
    assert trained.spans == [(0, 5), (10, 30), (40, 41)] and len(trained) == 26
    assert trained.covers(12, 30) and not trained.covers(4, 6) and trained.covers(7, 7)
    rest = Rest(trained)
    assert rest.length(100) == 74 and rest.length(35) == 35 - 25
    assert rest.positions(0, 12) == [(5, 10), (30, 37)]
    assert [rest.position(q) for q in range(5)] == [5, 6, 7, 8, 9]
    # Every position outside the intervals, once, in order.
    assert [p for a, b in rest.positions(0, 74) for p in range(a, b)] == [
        p for p in range(100) if not trained.covers(p, p + 1)
    ]


def test_the_orders_rows_in_a_window_are_shared_and_read_only():
    (window,) = windows(_parts([20]), 20, 5)
    order = window.rows_in_order()
    assert order is window.rows_in_order() and not order.flags.writeable
    assert sorted(order) == list(range(20)) and list(order) != list(range(20))
    assert np.array_equal(next(windows(_parts([3]), 2, None)).rows_in_order(), np.arange(3))
