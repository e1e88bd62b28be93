"""What the tools share: sweep expansion with its cell limit, and timed calls."""

from __future__ import annotations

import pytest
import torch

from cat.errors import ConfigError
from cat.toolkit.sweeps import MAX_SWEEP_CELLS, expand_sweep, override_axes
from cat.toolkit.timing import time_calls


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
