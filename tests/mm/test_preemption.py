"""cat.mm.preemption's resume of an iteration loop: the batches a run already trained are skipped as
indices, none of their images loaded, and the next batch is the one the uninterrupted run drew."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

pytest.importorskip("mmengine", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")


class CountingDataset(Dataset):
    def __init__(self, size: int) -> None:
        self.size, self.loaded = size, 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        self.loaded += 1
        return torch.tensor(index)


def _loader(batch: int):
    from cat.mm.preemption import ResumableInfiniteSampler

    dataset = CountingDataset(10)  # batches of 4 cross the permutation's end
    return DataLoader(dataset, batch_size=batch, sampler=ResumableInfiniteSampler(dataset, shuffle=True, seed=3))


def test_a_resumed_iteration_loop_loads_no_trained_batch():
    from cat.mm.preemption import _TrainedBatches

    uninterrupted = iter(_loader(4))
    expected = [next(uninterrupted) for _ in range(7)]
    resumed = _loader(4)
    next(iter(resumed))  # the pass a loop begins as it is built: it starts from the seed again below
    resumed.dataset.loaded = 0
    resumed.sampler.skip = 5 * 4
    batches = _TrainedBatches(iter(resumed), 5)
    assert [next(batches) for _ in range(5)] == [None] * 5 and resumed.dataset.loaded == 0
    assert torch.equal(next(batches), expected[5]) and torch.equal(next(batches), expected[6])
    assert resumed.dataset.loaded == 8
