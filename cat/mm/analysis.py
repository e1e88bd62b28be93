"""Counting handles for mmengine's FLOP analysis (``mmengine.analysis``: what mmdet's and mmseg's
``get_flops.py`` run), so a trace of a cat model counts what :func:`cat.flops.count_macs` counts.

mmengine traces the model (``torch.jit.trace``) and counts each recorded operator it has a handle for. Circulant
attention records itself there as one operator, ``cat::circulant_attention`` (:mod:`cat.ops.circulant`), counted
by the paper's formula; softmax attention through ``scaled_dot_product_attention`` is counted by its two products,
as torch's ``FlopCounterMode`` counts it for ``count_macs``. Both in multiply-accumulates, mmengine's unit.
"""

from __future__ import annotations

import math
from typing import Any

from cat.ops import circulant_attention_flops

__all__ = ["circulant_attention_handle", "register_flop_handles", "sdpa_handle"]


def _shape(value: Any) -> list[int]:
    from mmengine.analysis.jit_handles import get_shape

    shape = get_shape(value)
    if shape is None:
        raise ValueError("the trace recorded an input without a complete shape")
    return list(shape)


def circulant_attention_handle(inputs: list[Any], outputs: list[Any]) -> int:
    """``cat::circulant_attention(q, k, v, head_dim, scale)`` on (B, H, W, C) maps: B times the paper's count."""
    B, H, W, C = _shape(inputs[0])
    head_dim = inputs[3].toIValue()
    return B * circulant_attention_flops(H * W, C, head_dim)


def sdpa_handle(inputs: list[Any], outputs: list[Any]) -> int:
    """``scaled_dot_product_attention(q, k, v, ...)``, (..., L, E) queries, (..., S, E) keys, (..., S, Ev) values:
    the L x S products of the logits and of the output."""
    q, k, v = (_shape(value) for value in inputs[:3])
    return math.prod(q[:-2]) * q[-2] * k[-2] * (q[-1] + v[-1])


def register_flop_handles() -> None:
    """Add the handles to the ones every mmengine ``FlopAnalyzer`` starts with (its default table, which
    ``get_model_complexity_info`` offers no other way to extend)."""
    from mmengine.analysis import complexity_analysis

    complexity_analysis._DEFAULT_SUPPORTED_FLOP_OPS.update(
        {"cat::circulant_attention": circulant_attention_handle, "aten::scaled_dot_product_attention": sdpa_handle}
    )
