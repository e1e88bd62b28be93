"""What the tools share: sweep expansion with its cell limit, and timed calls."""

from __future__ import annotations

import pytest
import torch

from cat.errors import ConfigError
from cat.toolkit.sweeps import MAX_SWEEP_CELLS, expand_sweep, override_axes
from cat.toolkit.timing import interleaved_medians, paired_speedups, time_calls


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
