"""What the tools share: sweep expansion with its cell limit, and timed calls."""

from __future__ import annotations

import pytest
import torch

from cat.errors import ConfigError
from cat.toolkit.sweeps import MAX_SWEEP_CELLS, expand_sweep, override_axes
from cat.toolkit.timing import (
    interleaved_medians,
    op_differences,
    op_self_ms,
    paired_speedups,
    rotated,
    time_calls,
)


def test_expand_sweep_cells_and_preset_params():
    cells = expand_sweep(["model=a,b", "seed=0"], {"seed": "0,1", "lr": "1,2"})
    assert len(cells) == 4 and ("lr=1", "model=a", "seed=0") in cells  # the command line's seed wins
    assert override_axes(["epochs=3"]) == [("epochs", ["epochs=3"])]


def test_a_sweep_too_large_is_refused_before_expanding():
    with pytest.raises(ConfigError, match=f"at most {MAX_SWEEP_CELLS:,}"):
        expand_sweep(["a=range(0,100000)", "b=range(0,100000)"])


def test_time_calls_counts_calls():
    calls = []
    samples = time_calls(lambda: calls.append(1), iters=3, warmup=2, device=torch.device("cpu"), per_call=True)
    assert len(calls) == 5 and len(samples) == 3 and all(s >= 0 for s in samples)


def test_interleaved_rounds_give_every_function_every_place():
    """A fixed order gave one of two identical models a steady 14 % lead (docs/perf.md): each round starts one
    function later."""
    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in "abc"}
    interleaved_medians(fns, rounds=3, min_block_s=0.0)
    blocks = [name for i, name in enumerate(order) if i == 0 or order[i - 1] != name]  # a timer calls fn a few times
    rounds = [blocks[i : i + 3] for i in range(3, len(blocks), 3)]  # after the warm-up block of each
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]], blocks


def test_interleaved_medians_run_on_the_callers_threads():
    """torch.utils.benchmark's Timer runs on one thread unless told otherwise: the training table's medians were
    one-thread steps under a header that said two."""
    threads = torch.get_num_threads()
    seen = set()
    try:
        torch.set_num_threads(2)
        interleaved_medians({"f": lambda: seen.add(torch.get_num_threads())}, rounds=2, min_block_s=0.0)
    finally:
        torch.set_num_threads(threads)
    assert seen == {2}


def test_paired_speedups_alternate_the_order_and_see_a_slower_candidate():
    import time

    order = []

    def fast():
        order.append("fast")

    def slow():
        order.append("slow")
        time.sleep(0.005)

    speed = paired_speedups({"fast": fast, "slow": slow}, pairs=4, device=torch.device("cpu"))
    assert speed["fast"] == (1.0, 1.0, 1.0)
    median, q1, q3 = speed["slow"]
    assert q1 <= median <= q3 < 0.5  # 5 ms against nothing
    pairs = [tuple(order[i : i + 2]) for i in range(4, len(order), 2)]  # after two warm-up calls each
    assert pairs == [("fast", "slow"), ("slow", "fast")] * 2


def test_op_self_ms_profiles_each_function_interleaved():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    order = []

    def products():
        order.append("products")
        torch.mm(a, b)

    def sums():
        order.append("sums")
        torch.add(a, b)

    per_op = op_self_ms({"products": products, "sums": sums}, calls=3)
    assert per_op["products"]["aten::mm"] > 0 and "aten::mm" not in per_op["sums"]
    assert per_op["sums"]["aten::add"] > 0 and "aten::add" not in per_op["products"]
    assert order == ["products", "sums", "sums", "products", "products", "sums"]


def test_op_differences_pool_runs_by_median_and_count_the_runs_above():
    runs = [
        {"base": {"mm": 10.0, "conv": 4.0}, "new": {"mm": 11.0, "attn": 2.0}},
        {"base": {"mm": 12.0, "conv": 5.0}, "new": {"mm": 11.0, "attn": 3.0}},
        {"base": {"mm": 10.0, "conv": 6.0}, "new": {"mm": 13.0, "attn": 2.5}},
    ]
    rows = {row["op"]: row for row in op_differences(runs, "base", "new")}
    assert rows["mm"] == {"op": "mm", "baseline_ms": 10.0, "ms": 11.0, "diff_ms": 1.0, "runs_above": 2}
    assert rows["conv"] == {"op": "conv", "baseline_ms": 5.0, "ms": 0.0, "diff_ms": -5.0, "runs_above": 0}
    assert rows["attn"]["diff_ms"] == 2.5 and rows["attn"]["runs_above"] == 3
    assert [row["op"] for row in op_differences(runs, "base", "new")] == ["conv", "attn", "mm"]


def test_rotated_gives_each_name_every_place_over_a_cycle():
    names = ["a", "b", "c"]
    assert rotated(names, 4) == ["b", "c", "a"] and names == ["a", "b", "c"]
    orders = [rotated(names, k) for k in range(3)]
    assert all(sorted(order[place] for order in orders) == names for place in range(3))
