"""What a step of a circulant-attention model asks of the device, counted on a CPU at the dispatcher (every operator
a kernel launch on a GPU, views left out; the tensor memory it holds), and that a training step compiles whole. The
targets of docs/perf.md, "Kernels per step and the auto policy". Large steps are counted on tensors without data
(:func:`cat.toolkit.dispatch.sizes_only`: the same operators and storages, tests/toolkit/test_dispatch.py)."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F

import cat  # noqa: F401  (registers cat's models with timm)
from cat.ops import set_attention_memory, set_lean_attention
from cat.toolkit.dispatch import count_kernels, peak_tensor_bytes, sizes_only


def training_step(model: torch.nn.Module, batch: int, res: int):
    """Forward, cross-entropy and backward of ``model`` on one random batch (no optimizer: the model's own work)."""
    x = torch.randn(batch, 3, res, res)
    target = torch.randint(0, 1000, (batch,))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), target).backward()

    step()  # warm: lazily built constants (DFT matrices, Parseval weights) are made once, outside the count
    return step


def step_kernels(model: torch.nn.Module, batch: int, res: int = 224) -> int:
    return sum(count_kernels(training_step(model, batch, res)).values())


def sized_step_kernels(model: torch.nn.Module, batch: int, res: int = 224) -> int:
    """:func:`step_kernels` on tensors without data."""
    with sizes_only():
        return step_kernels(model, batch, res)


@pytest.fixture(scope="module")
def deit_kernels() -> int:
    return step_kernels(timm.create_model("deit_tiny_patch16_224"), 8)


def test_a_training_step_issues_as_many_kernels_at_any_batch_and_at_most_2_5x_deits(deit_kernels):
    """The default CA-DeiT-T at 224^2: the same kernels at batch 8 and 64 (the lean function's channel loop issued
    3.8x as many at 64, 7,924), and at most 2.5x DeiT-T's (it was 21x)."""
    model = timm.create_model("ca_deit_tiny")
    small = step_kernels(model, 8)
    assert sized_step_kernels(model, 8) == small  # the count without data is the real one (and so at batch 64)
    assert sized_step_kernels(model, 64) == small
    assert small <= 2.5 * deit_kernels, (small, deit_kernels)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "stored"])
def test_the_fused_function_issues_a_fixed_number_of_kernels_until_the_budget_splits_it(lean):
    """Both ways of keeping the backward's inputs issue a fixed number of kernels per block while the channels fit
    the memory budget in one group; only a budget smaller than the working set splits the lean function's channels
    (and so issues more)."""
    model = set_lean_attention(timm.create_model("ca_deit_tiny", img_size=64, depth=2), lean)
    counts = [step_kernels(model, batch, 64) for batch in (2, 32)]
    assert counts[0] == counts[1]
    set_attention_memory(model, 1)  # 1 MiB: the lean working set of 32 images of 16 tokens is 16 x 32 x 16 x 192 x 4 B
    split = step_kernels(model, 32, 64)
    assert split > counts[1] if lean else split == counts[1]


def test_inference_at_1536_takes_at_most_320_kernels():
    """CA-DeiT-T at 1536^2 (9,216 tokens), batch 1: the channel groups of the old lean path took 1,181."""
    model = timm.create_model("ca_deit_tiny", img_size=1536).eval()
    with torch.no_grad(), sizes_only():
        x = torch.randn(1, 3, 1536, 1536)
        model(x)
        kernels = sum(count_kernels(lambda: model(x)).values())
    assert kernels <= 320, kernels


def test_a_training_step_compiles_into_one_graph():
    """torch.compile's tracer sees the whole CA-DeiT-T, gradients included (the stored path is an autograd function
    it traces, forward and backward): no graph break, so fullgraph=True compiles it."""
    model = timm.create_model("ca_deit_tiny")
    explanation = torch._dynamo.explain(model)(torch.randn(2, 3, 224, 224))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    torch._dynamo.reset()
    small = timm.create_model("ca_deit_tiny", img_size=32, depth=2, num_classes=5)
    x, target = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    compiled = torch.compile(small, fullgraph=True, backend="aot_eager")
    F.cross_entropy(compiled(x), target).backward()
    grads = [p.grad.clone() for p in small.parameters()]
    small.zero_grad()
    F.cross_entropy(small(x), target).backward()
    for got, eager in zip(grads, (p.grad for p in small.parameters()), strict=True):
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_lean_training_holds_no_more_tensor_memory_than_deit_at_1024():
    """The lean function's point: a CA-DeiT-T training step at 1024^2 holds at most DeiT-T's tensor memory (0.93x
    measured; stored spectra: 1.32x)."""
    lean_model = set_lean_attention(timm.create_model("ca_deit_tiny", img_size=1024), True)
    deit_model = timm.create_model("deit_tiny_patch16_224", img_size=1024)
    with sizes_only():
        lean = peak_tensor_bytes(training_step(lean_model, 1, 1024))
        deit = peak_tensor_bytes(training_step(deit_model, 1, 1024))
    assert lean <= deit, (lean / 2**20, deit / 2**20)
