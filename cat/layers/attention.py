"""Softmax attention with the paper's token reweighting, for the last row of its Table 5."""

from __future__ import annotations

import torch.nn.functional as F
from timm.layers import Attention
from torch import Tensor, nn

__all__ = ["TokenReweightedAttention"]


class TokenReweightedAttention(Attention):
    """timm's softmax ``Attention`` whose output, before the projection, is multiplied by the token
    gate ``SiLU(Linear(x))`` (the post-reweighting circulant attention uses). Parameters are timm's
    (``qkv``, ``proj``) plus ``gate.0``, so DeiT weights load with only the gate missing."""

    def __init__(self, dim: int, *args, **kwargs) -> None:
        super().__init__(dim, *args, **kwargs)
        # timm's own `gate` (its sigmoid-gated option, a Linear or None) is replaced: its checkpoints' `gate.0`.
        self.gate = nn.Sequential(nn.Linear(dim, self.attn_dim), nn.SiLU())  # type: ignore[assignment]

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        dropout = self.attn_drop.p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, is_causal=is_causal)
        out = self.norm(out.transpose(1, 2).reshape(B, N, self.attn_dim)) * self.gate(x)  # type: ignore[misc]
        return self.proj_drop(self.proj(out))
