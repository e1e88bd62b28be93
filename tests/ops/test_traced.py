"""Circulant attention under torch.jit.trace (what mmengine's FLOP analysis runs): one operator,
``cat::circulant_attention``, in place of the lean function the tracer cannot record; the same output."""

from __future__ import annotations

import warnings

import pytest
import torch

import cat
from cat.ops import CirculantAttention


class _Grid(torch.nn.Module):
    def __init__(self, attn: CirculantAttention, hw: tuple[int, int]) -> None:
        super().__init__()
        self.attn, self.hw = attn, hw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, self.hw)


def traced(module: torch.nn.Module, x: torch.Tensor) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.trace's deprecation and shape-check notices
        return torch.jit.trace(module, x, check_trace=False)


@pytest.mark.parametrize("reweight", ["post", "pre", "none"])
@pytest.mark.parametrize("head_dim", [1, 4])
@pytest.mark.parametrize("lean", [True, False])
def test_a_traced_attention_is_one_operator_with_the_eager_output(reweight, head_dim, lean):
    torch.manual_seed(0)
    module = _Grid(CirculantAttention(16, head_dim=head_dim, reweight=reweight, lean=lean).double(), (4, 6))
    x = torch.randn(2, 24, 16, dtype=torch.float64)
    graph = traced(module, x)  # gradients on: the lean function would be taken eagerly
    assert str(graph.inlined_graph).count("cat::circulant_attention") == 1
    torch.testing.assert_close(graph(x), module(x), rtol=1e-10, atol=1e-12)


def test_a_traced_converted_vit_with_class_token_and_qkv_bias_gives_the_eager_logits():
    torch.manual_seed(0)
    model = cat.convert(cat.create_model("deit_tiny_patch16_224", img_size=64, depth=2, num_classes=5)).eval()
    x = torch.randn(2, 3, 64, 64)
    graph = traced(model, x)
    assert str(graph.inlined_graph).count("cat::circulant_attention") == 2
    torch.testing.assert_close(graph(x), model(x), rtol=1e-4, atol=1e-5)
