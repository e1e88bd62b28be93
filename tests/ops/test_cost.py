"""What a step of a circulant-attention model asks of the device, counted on a CPU at the dispatcher (every operator
a kernel launch on a GPU, views left out; the tensor memory it holds), and that a training step compiles whole. The
targets of docs/perf.md, "Kernels per step and the auto policy". Large steps are counted on tensors without data
(:func:`cat.toolkit.dispatch.sizes_only`: the same operators and storages, tests/toolkit/test_dispatch.py)."""

from __future__ import annotations

from collections import Counter

import pytest
import timm
import torch
import torch.nn.functional as F

import cat  # noqa: F401  (registers cat's models with timm)
from cat.ops import set_attention_memory, set_lean_attention
from cat.toolkit.dispatch import count_kernels, peak_tensor_bytes, sizes_only


def training_step(model: torch.nn.Module, batch: int, res: int, amp: bool = False):
    """Forward, cross-entropy and backward of ``model`` on one random batch (no optimizer: the model's own work); with
    ``amp`` the forward and the loss under bf16 autocast, the backward outside it, as the trainer runs them."""
    x = torch.randn(batch, 3, res, res)
    target = torch.randint(0, model.num_classes, (batch,))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x), target)
        loss.backward()

    step()  # warm: lazily built constants (DFT matrices) are made once, outside the count
    return step


def step_kernels(model: torch.nn.Module, batch: int, res: int = 224, amp: bool = False) -> int:
    return sum(count_kernels(training_step(model, batch, res, amp)).values())


def sized_step_kernels(model: torch.nn.Module, batch: int, res: int = 224, amp: bool = False) -> int:
    """:func:`step_kernels` on tensors without data."""
    with sizes_only():
        return step_kernels(model, batch, res, amp)


@pytest.fixture(scope="module")
def deit_kernels() -> dict[bool, int]:
    """DeiT-T's (SDPA) training step at 224^2, batch 64, in float32 and under bf16 autocast."""
    model = timm.create_model("deit_tiny_patch16_224")
    return {amp: sized_step_kernels(model, 64, amp=amp) for amp in (False, True)}


def test_a_training_step_issues_as_many_kernels_at_any_batch_and_fewer_than_before(deit_kernels):
    """The default CA-DeiT-T at 224^2: the same kernels at batch 8 and 64 (the lean function's channel loop issued
    3.8x as many at 64), in float32 at most 1.95x DeiT-T's (736 against 378; it was 808, 2.14x; the 1.5x of
    docs/perf.md's target is not reached: the operators that remain are listed there) and under bf16 autocast at
    most 1.5x (975 against 657; it was 1,239)."""
    model = timm.create_model("ca_deit_tiny")
    small = step_kernels(model, 8)
    assert sized_step_kernels(model, 8) == small  # the count without data is the real one (and so at batch 64)
    assert sized_step_kernels(model, 64) == small
    assert small <= 1.95 * deit_kernels[False], (small, deit_kernels)
    half = sized_step_kernels(model, 64, amp=True)
    assert sized_step_kernels(model, 8, amp=True) == half
    assert half <= 1.5 * deit_kernels[True], (half, deit_kernels)


def block_kernels(name: str, amp: bool) -> Counter[str]:
    """The operators one more block adds to a training step (a 2-block model's less a 1-block one's), by name."""
    counts = []
    for depth in (1, 2):
        model = timm.create_model(name, img_size=64, depth=depth, num_classes=10)
        counts.append(count_kernels(training_step(model, 2, 64, amp)))
    return counts[1] - counts[0]


def test_a_block_casts_under_autocast_no_more_than_deits_plus_two():
    """Half precision without a cast per operator: a CA-DeiT-T block under bf16 autocast casts (aten._to_copy) no
    more than a DeiT-T block plus two (20 against 22: the spectral path stays in float32, the input is cast with the
    copy the transform needs, the gate's and projection's weights once per step; it cast 35 times)."""
    ca, deit = block_kernels("ca_deit_tiny", True), block_kernels("deit_tiny_patch16_224", True)
    assert ca["aten._to_copy"] <= deit["aten._to_copy"] + 2, (ca, deit)
    fp32 = block_kernels("ca_deit_tiny", False)
    assert fp32["aten._to_copy"] <= 1  # the copy into maps; no cast in float32
    assert sum(ca.values()) - ca["aten._to_copy"] == sum(fp32.values()) - fp32["aten._to_copy"]  # casts only


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


def inference_kernels(name: str, res: int, attention_kernel: str = "auto", reparameterized: bool = False) -> int:
    """The operators of one forward at ``res``, batch 1, in eval mode; ``reparameterized`` as cat's inference tools
    run it (:func:`cat.toolkit.variants.inference_variant`: timm.utils.reparameterize_model)."""
    from timm.utils.model import reparameterize_model

    from cat.ops import set_attention_kernel

    model = set_attention_kernel(timm.create_model(name, img_size=res).eval(), attention_kernel)
    if reparameterized:
        reparameterize_model(model, inplace=True)
    with torch.no_grad(), sizes_only():
        x = torch.randn(1, 3, res, res)
        model(x)
        return sum(count_kernels(lambda: model(x)).values())


def test_inference_at_1536_takes_at_most_2_25x_deits_kernels():
    """CA-DeiT-T at 1536^2 (9,216 tokens), batch 1: 281 operators against DeiT-T's 125 (the channel groups of the
    old lean path took 1,181, then 293); the 1.6x target is not reached (docs/perf.md)."""
    assert inference_kernels("ca_deit_tiny", 1536) <= 2.25 * inference_kernels("deit_tiny_patch16_224", 1536)


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


def test_lean_training_is_the_memory_mode_and_auto_stays_within_1_5x_deit_at_1024():
    """The lean function's point: a CA-DeiT-T training step at 1024^2, batch 1, with the default budget holds at most
    0.9x DeiT-T's tensor memory (0.88x measured: its backward drops each intermediate once used); auto, which keeps
    the spectra there, at most 1.5x (1.37x)."""
    deit_model = timm.create_model("deit_tiny_patch16_224", img_size=1024)
    models = {
        lean: set_lean_attention(timm.create_model("ca_deit_tiny", img_size=1024), lean) for lean in (True, "auto")
    }
    with sizes_only():
        deit = peak_tensor_bytes(training_step(deit_model, 1, 1024))
        peaks = {lean: peak_tensor_bytes(training_step(model, 1, 1024)) for lean, model in models.items()}
    assert peaks[True] <= 0.9 * deit and peaks["auto"] <= 1.5 * deit, ({k: v / deit for k, v in peaks.items()}, deit)


@pytest.fixture(scope="module")
def kernel_counts(deit_kernels) -> dict[str, tuple[int, int]]:
    """CA-DeiT-T through the Triton kernels (one operator each way per block) against DeiT-T (SDPA): the training step
    at 224^2 batch 64 in float32 and under bf16 autocast, inference at 1536^2 batch 1 (operators), and the training
    step's tensor memory at 1024^2 batch 1 (bytes)."""
    from cat.ops import set_attention_kernel

    def through_kernels(res: int) -> torch.nn.Module:
        return set_attention_kernel(timm.create_model("ca_deit_tiny", img_size=res), "triton")

    models = through_kernels(1024), timm.create_model("deit_tiny_patch16_224", img_size=1024)
    with sizes_only():
        memory = tuple(peak_tensor_bytes(training_step(model, 1, 1024)) for model in models)
    return {
        "fp32": (sized_step_kernels(through_kernels(224), 64), deit_kernels[False]),
        "bf16": (sized_step_kernels(through_kernels(224), 64, amp=True), deit_kernels[True]),
        "infer_1536": (
            inference_kernels("ca_deit_tiny", 1536, "triton", reparameterized=True),
            inference_kernels("deit_tiny_patch16_224", 1536, reparameterized=True),
        ),
        "memory_1024": memory,
    }


def test_the_kernels_count_as_one_operator_each_way(kernel_counts):
    """With the kernels a block's attention, its gate included, is one operator each way: CA-DeiT-T's training step
    issues 1.09x DeiT-T's operators in float32 (412 against 378; the ATen path: 1.95x) and 0.97x under bf16 autocast
    (639 against 657; 1.5x): q, k, v and the gate come from one GEMM, the kernels apply the gate, and the backward
    makes the projection again (one GEMM a block) instead of keeping it. What remains beyond DeiT-T is each block's
    depthwise convolution and its centre tap and the join of the two projections' weights. Inference at 1536^2,
    reparameterized as cat's inference tools run it (the centre tap and the join made once): 1.10x (137 against 125;
    the convolution a block; 161, 1.29x, without). Training memory at 1024^2, batch 1: 0.89x DeiT-T's: a block keeps
    its attention's input, not its (B, N, 4C) projection (1.13x when it kept it; the stored ATen path: 1.37x)."""
    ratios = {name: ours / deit for name, (ours, deit) in kernel_counts.items()}
    assert ratios["fp32"] <= 1.1 and ratios["bf16"] <= 1.0 and ratios["infer_1536"] <= 1.1, kernel_counts
    assert ratios["memory_1024"] <= 0.9, kernel_counts
