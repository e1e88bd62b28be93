"""Softmax attention of a few tokens over all tokens, from a qkv projection's weights and the tokens alone:
the class and register tokens of a ViT converted by :func:`cat.convert`, whose grid tokens attend circulantly
and never form keys or values in token space.

Per head h, q_h . k_j = (W_k,h^T q_h) . x_j + q_h . b_k,h, and the softmax drops the last term, the same for
every key j; the weights sum to 1, so sum_j a_j v_j = W_v,h (sum_j a_j x_j) + b_v,h. So the heads * P queries
W_k,h^T q_h attend to x itself, keys and values alike. These are products of a few rows with x; one autograd
node with its own backward runs them in the orientation CPU GEMMs handle well (x or the weights on the left of
few-column operands) and sums x's three gradient terms in one product, where autograd through SDPA and
einsums took about twice as long (docs/perf.md, attempt 18).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .fused import value_bias
from .policy import compute_dtype
from .precision import no_autocast

__all__ = ["prefix_attention"]


def prefix_attention(x: Tensor, qkv_weight: Tensor, qkv_bias: Tensor | None, num_prefix: int, num_heads: int) -> Tensor:
    """Softmax attention (``num_heads`` heads, scale 1/sqrt(head width)) of the first ``num_prefix`` tokens of
    x (B, T, C_in) over all T tokens, with q, k, v = x W^T + b for ``qkv_weight`` (3C, C_in) and ``qkv_bias``
    (3C,) or None: the attention output (B, num_prefix, C), before any output projection. Under autocast it
    runs in autocast's dtype (the softmax in float32), as SDPA would; its gradients have the inputs' dtypes."""
    C = qkv_weight.shape[0] // 3
    if x.dim() != 3 or x.shape[-1] != qkv_weight.shape[1] or qkv_weight.shape[0] != 3 * C or C % num_heads:
        raise ValueError(
            f"prefix_attention expects x (B, T, C_in) and qkv_weight (3C, C_in) with C divisible by "
            f"num_heads={num_heads}; got x {tuple(x.shape)}, qkv_weight {tuple(qkv_weight.shape)}"
        )
    if not 0 < num_prefix <= x.shape[1]:
        raise ValueError(f"num_prefix={num_prefix} must be between 1 and the token count {x.shape[1]}")
    return _PrefixAttention.apply(x, qkv_weight, qkv_bias, num_prefix, num_heads)


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half and bfloat16 inputs, as autocast runs softmax; the input's dtype otherwise."""
    return torch.promote_types(dtype, torch.float32)


def _split_weight(weight: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """qkv's weight (3C, C_in) as W_q (C, C_in) and W_k, W_v per head, (heads, C / heads, C_in)."""
    w_q, w_k, w_v = weight.chunk(3)
    return w_q, w_k.unflatten(0, (heads, -1)), w_v.unflatten(0, (heads, -1))


def _per_head(t: Tensor, heads: int) -> Tensor:
    """(B, P, heads * d) as (heads, B * P, d): a batch of per-head matrices for bmm."""
    B, P, width = t.shape
    return t.reshape(B * P, heads, width // heads).transpose(0, 1)


def _per_token(t: Tensor, B: int) -> Tensor:
    """(heads, B * P, d) back to (B, P * heads, d), the queries' layout (P major, heads minor)."""
    return t.transpose(0, 1).reshape(B, -1, t.shape[-1])


class _PrefixAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, qkv_weight, qkv_bias, P, heads):
        dtype = compute_dtype(x)
        B, _, C_in = x.shape
        C = qkv_weight.shape[0] // 3
        scale = (C // heads) ** -0.5
        with no_autocast(x.device):
            xs, weight = x.to(dtype), qkv_weight.to(dtype)
            bias = qkv_bias.to(dtype) if qkv_bias is not None else None
            w_q, w_k, w_v = _split_weight(weight, heads)
            q = F.linear(xs[:, :P], w_q, bias[:C] if bias is not None else None)  # (B, P, C)
            # Scaled before the product, as SDPA scales q: half-precision logits stay in range.
            queries = _per_token(torch.bmm(_per_head(q, heads), w_k), B).mul_(scale)  # (B, P * heads, C_in)
            # Token-major weights (B, T, P * heads): x on the left, where the few columns are cheap.
            a = torch.bmm(xs, queries.transpose(1, 2)).to(_softmax_dtype(dtype)).softmax(1)
            mixed = torch.bmm(a.to(dtype).transpose(1, 2), xs)  # (B, P * heads, C_in)
            out = torch.bmm(_per_head(mixed.reshape(B, P, -1), heads), w_v.transpose(1, 2))
            out = _per_token(out, B).reshape(B, P, C)
            if bias is not None:
                out = out + value_bias(bias, 0, C)
        ctx.save_for_backward(x, qkv_weight, qkv_bias, q, queries, a, mixed)
        ctx.heads, ctx.dtype = heads, dtype
        return out

    @staticmethod
    def backward(ctx, g_out):
        x, qkv_weight, qkv_bias, q, queries, a, mixed = ctx.saved_tensors
        heads, dtype = ctx.heads, ctx.dtype
        B, _, C_in = x.shape
        P = q.shape[1]
        C = qkv_weight.shape[0] // 3
        scale = (C // heads) ** -0.5
        with no_autocast(x.device):
            # x cast again rather than its cast saved: under autocast that copy would be a second x in memory.
            xs, weight, g = x.to(dtype), qkv_weight.to(dtype), g_out.to(dtype)
            w_q, w_k, w_v = _split_weight(weight, heads)
            g_h = _per_head(g, heads)  # (heads, B * P, width)
            mixed_h = _per_head(mixed.reshape(B, P, -1), heads)  # (heads, B * P, C_in)
            g_w_v = torch.bmm(g_h.transpose(1, 2), mixed_h).reshape(C, C_in)
            g_mixed = _per_token(torch.bmm(g_h, w_v), B)  # (B, P * heads, C_in)
            g_a = torch.bmm(xs, g_mixed.transpose(1, 2)).to(a.dtype)
            g_logits = (a * (g_a - (g_a * a).sum(1, keepdim=True))).to(dtype)
            g_queries = torch.bmm(g_logits.transpose(1, 2), xs).mul_(scale)  # of the unscaled queries
            # x's gradient as keys and as values in one product; its prefix rows', as queries, below.
            g_x = torch.bmm(torch.cat([a.to(dtype), g_logits], 2), torch.cat([g_mixed, queries], 1))
            g_queries_h = _per_head(g_queries.reshape(B, P, -1), heads)  # (heads, B * P, C_in)
            g_q = _per_token(torch.bmm(g_queries_h, w_k.transpose(1, 2)), B).reshape(B, P, C)
            g_w_k = torch.bmm(_per_head(q, heads).transpose(1, 2), g_queries_h).reshape(C, C_in)
            g_x[:, :P] += torch.matmul(g_q, w_q)
            g_w_q = g_q.reshape(B * P, C).t() @ xs[:, :P].reshape(B * P, C_in)
            g_weight = torch.cat([g_w_q, g_w_k, g_w_v]).to(qkv_weight.dtype)
            g_bias = None
            if qkv_bias is not None:  # k's bias shifts every logit alike: no gradient
                g_bias = torch.cat([g_q.sum((0, 1)), g.new_zeros(C), g.sum((0, 1))]).to(qkv_bias.dtype)
        return g_x.to(x.dtype), g_weight, g_bias, None, None
