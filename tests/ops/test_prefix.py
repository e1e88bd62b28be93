"""The prefix tokens' softmax attention (cat.ops.prefix): the source attention's values and gradients, gradcheck,
autocast, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cat.ops.prefix import prefix_attention


def source_attention(x, weight, bias, P, heads):
    """What a timm ViT's attention computes for its first P tokens: q, k, v for every token, SDPA per head."""
    B, T, _ = x.shape
    q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in F.linear(x, weight, bias).chunk(3, dim=-1))
    return F.scaled_dot_product_attention(q[:, :, :P], k, v).transpose(1, 2).reshape(B, P, -1)


def inputs(B=2, T=11, C_in=12, C=12, bias=True, dtype=torch.float64):
    torch.manual_seed(0)
    x = torch.randn(B, T, C_in, dtype=dtype, requires_grad=True)
    weight = (torch.randn(3 * C, C_in, dtype=dtype) / C_in**0.5).requires_grad_()
    b = torch.randn(3 * C, dtype=dtype, requires_grad=True) if bias else None
    return x, weight, b


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("P, heads", [(1, 3), (2, 1), (3, 4)])
def test_equals_the_source_attention_values_and_gradients(bias, P, heads):
    x, weight, b = inputs(bias=bias)
    params = [t for t in (x, weight, b) if t is not None]
    g = torch.randn(2, P, 12, dtype=torch.float64)
    results = []
    for fn in (prefix_attention, source_attention):
        out = fn(x, weight, b, P, heads)
        results.append((out.detach(), torch.autograd.grad(out, params, g)))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=1e-12)
    for got, expected in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    if bias:  # k's bias cannot change a softmax over keys
        assert results[0][1][2][12:24].abs().max() == 0


def test_gradcheck_with_a_wider_input_than_output():
    x, weight, b = inputs(T=9, C_in=10, C=8)
    assert torch.autograd.gradcheck(lambda *t: prefix_attention(*t, 2, 2), (x, weight, b))


def test_bf16_autocast_runs_in_bf16_with_gradients_in_the_inputs_dtype():
    x, weight, b = inputs(T=50, C_in=64, C=64, dtype=torch.float32)
    grads = {}
    for amp in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = prefix_attention(x, weight, b, 1, 4)
        assert out.dtype == (torch.bfloat16 if amp else torch.float32)
        grads[amp] = torch.autograd.grad(out.float().square().sum(), (x, weight, b))
    for got, expected in zip(grads[True], grads[False], strict=True):
        assert got.dtype == torch.float32
        assert (got - expected).norm() / expected.norm() < 3e-2


def test_bad_input_is_named():
    x, weight, b = inputs()
    with pytest.raises(ValueError, match="num_heads=5"):
        prefix_attention(x, weight, b, 1, 5)
    with pytest.raises(ValueError, match=r"qkv_weight \(3C, C_in\)"):
        prefix_attention(x[..., :5], weight, b, 1, 3)
    with pytest.raises(ValueError, match="num_prefix=0"):
        prefix_attention(x, weight, b, 0, 3)
