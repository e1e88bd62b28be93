"""The released CA-DeiT attention pipeline, written literally: the numerics contract and the
baseline the fast module is benchmarked against. Not used by the models."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .circulant import CirculantAttention

__all__ = ["released_circulant_attention"]


def released_circulant_attention(attn: CirculantAttention, x: Tensor, hw: tuple[int, int]) -> Tensor:
    """The authors' computation with ``attn``'s weights: tokens as (B, H, W, C), ortho-normalised
    ``rfft2`` over dims (1, 2), the qkv weight applied to ``view_as_real`` of the spectrum."""
    B, N, C = x.shape
    H, W = hw
    assert attn.gate is not None, "the release gates every block (reweight='post')"
    gate = cast(nn.Linear, attn.gate[0])
    t = F.silu(F.linear(x, gate.weight, gate.bias))
    X = torch.fft.rfft2(x.view(B, H, W, C), dim=(1, 2), norm="ortho")
    qkv = F.linear(torch.view_as_real(X).transpose(-1, -2), attn.qkv.weight)
    if qkv.dtype == torch.bfloat16:  # bf16 autocast: view_as_complex takes no bfloat16 (the FFTs run in float32)
        qkv = qkv.float()
    q, k, v = torch.view_as_complex(qkv.transpose(-1, -2).contiguous()).chunk(3, dim=-1)
    logits = torch.fft.irfft2(torch.conj(q) * k, s=(H, W), dim=(1, 2), norm="ortho")
    weights = logits.reshape(B, N, C).softmax(dim=1).view(B, H, W, C)
    A = torch.fft.rfft2(weights, dim=(1, 2))
    y = torch.fft.irfft2(torch.conj(A) * v, s=(H, W), dim=(1, 2), norm="ortho").reshape(B, N, C)
    return F.linear(y * t, attn.proj.weight, attn.proj.bias)
