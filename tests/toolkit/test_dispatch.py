"""cat.toolkit.dispatch: the operators a computation dispatches and the tensor memory it holds, counted exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from cat.toolkit.dispatch import KernelCounter, count_kernels, peak_tensor_bytes, sizes_only
from cat.toolkit.variants import build_variant


def test_kernels_are_counted_and_views_are_not():
    a, b = torch.randn(4, 8), torch.randn(8, 3)

    def work() -> None:
        c = a @ b  # one kernel
        c.view(3, 4).t().unsqueeze(0)  # views: none
        (c + 1).relu_().sum()  # three
        c.t().reshape(-1)  # a reshape that must copy: one

    counts = count_kernels(work)
    assert counts == {"aten.mm": 1, "aten.add": 1, "aten.relu_": 1, "aten.sum": 1, "aten.clone": 1}
    with KernelCounter() as counter:
        work()
        work()
    assert counter.total == 10


def test_the_backward_is_counted_too():
    x = torch.randn(5, 5, requires_grad=True)
    counts = count_kernels(lambda: (x.exp() * 2).sum().backward())
    assert counts["aten.exp"] == 1 and counts["aten.mul"] >= 2  # forward, and exp's and mul's gradients


def test_peak_tensor_memory_counts_what_lives_at_once_and_not_what_existed_before():
    before = torch.zeros(1000)  # not counted: made before

    def work() -> None:
        a = torch.ones(1000)  # 4000 B
        b = a * 2  # 8000 B alive
        del a
        c = b + before  # 8000 B alive again: a was freed
        c.add_(1)  # in place: nothing new
        del b, c
        d = torch.empty(250)  # 1000 B
        del d

    assert peak_tensor_bytes(work) == 8000
    kept = []
    assert peak_tensor_bytes(lambda: kept.append(torch.ones(10) * 3)) == 80  # ones, then the product beside it


@pytest.mark.parametrize("name", ["ca_deit_tiny", "ca_deit_tiny+lean", "deit_tiny_patch16_224"])
def test_sizes_only_counts_what_the_real_step_dispatches_and_holds(name):
    """A training step (forward, loss, backward) on tensors without data: the same operators, each as often, and the
    same most tensor memory as the real step, here at 64^2 (circulant attention's lean and stored paths, timm's
    SDPA attention)."""
    model = build_variant(name, 64, "cpu", {"depth": 2})
    x, target = torch.randn(2, 3, 64, 64), torch.tensor([3, 1])

    def step() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), target).backward()

    step()  # lazily built constants made once, outside the counts
    real = (count_kernels(step), peak_tensor_bytes(step))
    with sizes_only():
        x, target = torch.randn(2, 3, 64, 64), torch.tensor([3, 1])  # what step() reads, now without data
        assert isinstance(x, FakeTensor)
        assert (count_kernels(step), peak_tensor_bytes(step)) == real
