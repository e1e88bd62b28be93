"""Circulant attention as a plug-in: :func:`convert` turns the attention of a timm ViT (DeiT, EVA),
Swin or PVT v2 into circulant attention in place, reusing each block's trained projections.

A converted attention computes q, k, v with the block's own qkv weights (and biases), runs circulant
attention over the token grid, multiplies the token gate ``SiLU(Linear(x))`` in and applies the
block's own output projection. The gate starts at exactly 1 (zero weight, bias b with SiLU(b) = 1),
so a converted block differs from the original only by its attention map: the BCCB matrix instead of
the dense softmax one. Class and register tokens of a ViT keep softmax attention over all tokens
(O(N) for a handful of queries); the grid tokens attend circulantly among themselves. Window
masks, relative-position tables, rotary embeddings and PVT's spatial reduction are dropped: circulant
attention is global and translation-equivariant. Everything else of the model (and its timm API) is untouched.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from typing import Any, cast

import torch
from timm.layers import PatchEmbed
from timm.layers.attention import AttentionRope
from timm.models.eva import EvaAttention
from timm.models.pvt_v2 import Attention as PvtV2Attention
from timm.models.swin_transformer import SwinTransformerBlock
from timm.models.vision_transformer import Attention as VitAttention
from torch import Tensor, nn

from cat.ops.circulant import FFTBackend, circulant_attention_layer
from cat.ops.policy import KernelPolicy, LeanPolicy, check_lean
from cat.ops.prefix import prefix_attention

__all__ = ["convert", "PluginCirculantAttention", "GATE_IDENTITY_BIAS"]

# The root of SiLU(b) = b * sigmoid(b) = 1: a gate with zero weight and this bias multiplies by 1.
GATE_IDENTITY_BIAS = 1.2784645427610738


class PluginCirculantAttention(nn.Module):
    """Circulant attention built from a timm attention's weights.

    Called with tokens (B, P + H*W, C), P prefix tokens first, and the grid ``hw`` as a second
    argument (PVT v2 passes it), or with ``hw=None`` to use the grid the model's patch embedding
    recorded for this forward (ViT blocks do not pass it; see :func:`convert`). Parameters:
    ``qkv``, ``proj`` (the source's, reused), ``gate.0`` (new). ``keep_weights`` and ``last_weights`` are
    :class:`~cat.ops.CirculantAttention`'s (the grid's attention weights (B, heads, H, W) of each forward), and
    so are ``lean`` and ``fft_backend``.
    """

    def __init__(
        self,
        qkv: nn.Linear,
        proj: nn.Linear,
        num_heads: int,
        head_dim: int = 1,
        num_prefix_tokens: int = 0,
        lean: LeanPolicy = "auto",
    ) -> None:
        super().__init__()
        dim = proj.in_features
        if dim % head_dim:
            raise ValueError(f"head_dim={head_dim} must divide the attention width {dim}")
        self.qkv, self.proj = qkv, proj
        gate = nn.Linear(qkv.in_features, dim)
        nn.init.zeros_(gate.weight)
        nn.init.constant_(gate.bias, GATE_IDENTITY_BIAS)
        self.gate = nn.Sequential(gate, nn.SiLU())
        self.num_heads = num_heads  # of the prefix tokens' softmax attention, as in the source
        self.head_dim = head_dim
        self.num_prefix_tokens = num_prefix_tokens
        self.lean = check_lean(lean)  # as CirculantAttention's (cat.ops.set_lean_attention sets it)
        self.grid: tuple[int, int] | None = None
        self.keep_weights = False
        self.last_weights: Tensor | None = None
        self.fft_backend: FFTBackend = "auto"  # as CirculantAttention's (cat.ops.set_fft_backend sets it)
        self.memory_mb: int | None = None  # as CirculantAttention's (cat.ops.set_attention_memory sets it)
        self.attention_kernel: KernelPolicy = "auto"  # as CirculantAttention's (cat.ops.set_attention_kernel sets it)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, num_prefix_tokens={self.num_prefix_tokens}, lean={self.lean}"

    def set_window_size(self, window_size: Any) -> None:
        """Swin's resize hook: circulant attention has no window."""

    def forward(self, x: Tensor, hw: Sequence[int] | None = None, **_block_kwargs: Any) -> Tensor:
        # _block_kwargs: what ViT/EVA blocks pass to softmax attention (masks, rope), meaningless here.
        hw = self.grid if hw is None else hw
        T, P = x.shape[1], self.num_prefix_tokens
        if hw is None or hw[0] * hw[1] != T - P:
            raise ValueError(f"{T} tokens ({P} prefix) do not fit the grid {hw}")
        qkv_weight, qkv_bias = self.qkv.weight, self.qkv.bias
        # The prefix tokens: softmax attention over all tokens, from x and the source's weights.
        prefix = prefix_attention(x, qkv_weight, qkv_bias, P, self.num_heads) if P else None
        # The native layer: the grid's q, k, v from one FFT of x and its spectrum's GEMM (of the bias only v's
        # part acts, added to the output), the prefix tokens gated and projected with the grid, the lean policy
        # as native.
        out, weights = circulant_attention_layer(
            x,
            (hw[0], hw[1]),
            qkv_weight,
            self.gate[0].weight,
            self.gate[0].bias,
            self.proj.weight,
            self.proj.bias,
            self.head_dim,
            None,
            "post",
            self.fft_backend,
            self.lean,
            self.memory_mb,
            self.keep_weights,
            False,
            qkv_bias,
            prefix,
            self.attention_kernel,
        )
        if self.keep_weights:
            self.last_weights = weights.detach()
        return out


class CirculantSwinBlock(SwinTransformerBlock):
    """timm's Swin block with global circulant attention in place of (shifted) window attention."""

    def _attn(self, x: Tensor) -> Tensor:
        B, H, W, C = x.shape
        return self.attn(x.reshape(B, H * W, C), (H, W)).reshape(B, H, W, C)


class _GridRecorder:
    """Forward pre-hook of a ViT's patch embedding: tells its converted attentions this forward's grid."""

    def __init__(self, attentions: list[PluginCirculantAttention]) -> None:
        self.attentions = attentions

    def __call__(self, patch_embed: PatchEmbed, args: tuple[Tensor, ...]) -> None:
        grid = patch_embed.dynamic_feat_size(cast(tuple[int, int], args[0].shape[-2:]))  # (traced: symbolic)
        for attention in self.attentions:
            attention.grid = grid


def _linear(weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> nn.Linear:
    """One Linear from row blocks of weights and their biases (None: zero)."""
    weight = torch.cat(list(weights))
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=any(b is not None for b in biases))
    layer.to(weight.device, weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if layer.bias is not None:
            rows = [torch.zeros(w.shape[0]) if b is None else b for w, b in zip(weights, biases, strict=True)]
            layer.bias.copy_(torch.cat([r.to(weight) for r in rows]))
    return layer


def _qkv_of(attn: nn.Module) -> nn.Linear:
    """The source attention's q, k, v projection as one Linear (its own module where it has one)."""
    if isinstance(attn, PvtV2Attention):  # its norm belongs to the spatial reduction, dropped
        return _linear([attn.q.weight, attn.kv.weight], [attn.q.bias, attn.kv.bias])
    for norm in ("q_norm", "k_norm", "norm"):
        if not isinstance(getattr(attn, norm, None), nn.Identity | None):
            raise ValueError(f"{type(attn).__name__} with a {norm} layer cannot be converted")
    # EVA's other attention (the ROPE ViTs); timm 1.0.20's has neither the output gate nor grouped queries.
    if isinstance(attn, AttentionRope):
        if getattr(attn, "gate", None) is not None:
            raise ValueError("AttentionRope with an output gate (gated=True) cannot be converted")
        if getattr(attn, "num_kv_groups", 1) > 1:
            raise ValueError(
                f"AttentionRope with grouped-query attention (num_kv_heads={attn.num_kv_heads} of "
                f"{attn.num_heads}) cannot be converted: circulant attention needs keys and values as wide as queries"
            )
    if isinstance(attn, EvaAttention | AttentionRope) and attn.qkv is None:
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        return _linear([p.weight for p in projections], [p.bias for p in projections])
    if isinstance(attn, EvaAttention):  # a bias-free qkv Linear, q's and v's biases apart
        width = attn.qkv.weight.shape[0] // 3
        return _linear(list(attn.qkv.weight.split(width)), [attn.q_bias, None, attn.v_bias])
    return cast(nn.Linear, attn.qkv)  # ViT/DeiT, AttentionRope and Swin: one qkv Linear, with its bias


def _plugin(attn: Any, head_dim: int, num_prefix_tokens: int = 0) -> PluginCirculantAttention:
    """``attn`` (any of timm's attention classes :func:`_qkv_of` reads) as circulant attention."""
    qkv = _qkv_of(attn)
    if qkv.out_features != 3 * qkv.in_features:
        raise ValueError(
            f"{type(attn).__name__} attends in {qkv.out_features // 3} channels of {qkv.in_features}-channel "
            "tokens: circulant attention attends in the tokens' own channels"
        )
    plugin = PluginCirculantAttention(qkv, attn.proj, attn.num_heads, head_dim, num_prefix_tokens)
    return plugin.to(attn.proj.weight.device)


# Block names of hierarchical models, as the model or a features_only wrapper (which flattens
# "layers.1" to "layers_1") names them; group 1 is the stage index.
_STAGE_BLOCK = re.compile(r"(?:layers|stages)[._](\d+)\.blocks\.\d+$")
PAPER_STAGES = (0, 1)  # the paper's CCSS
_BLOCK_LISTS = (nn.Sequential, nn.ModuleList)  # a ViT's blocks (EVA: a ModuleList)


def convert(
    model: nn.Module,
    blocks: str | Sequence[str] | None = None,
    stages: Sequence[int] | None = None,
    head_dim: int = 1,
) -> nn.Module:
    """Replace softmax attention by circulant attention in the chosen blocks of a timm model, in place.

    Args:
        model: a timm ViT/DeiT/EVA, Swin or PVT v2, or a ``features_only`` wrapper of one.
        blocks: fnmatch patterns of block names to convert (``"blocks.*"``, ``"layers.0.blocks.1"``).
        stages: for Swin and PVT v2, the stages to convert (all their blocks). Without ``blocks`` or
            ``stages``: every block of a ViT, the first two stages of a hierarchical model (the
            paper's ``CCSS``).
        head_dim: channels per circulant head; 1 (per-channel weights) is the paper's choice.

    Returns ``model``; ``model.circulant_blocks`` lists the converted block names. Raises
    ``ValueError`` if nothing matched or the model holds no supported attention.
    """
    patterns = [blocks] if isinstance(blocks, str) else list(blocks or [])

    def wanted(name: str, stage: int | None) -> bool:
        if not patterns and stages is None:  # the defaults
            return stage is None or stage in PAPER_STAGES
        return (stage is not None and stage in (stages or ())) or any(fnmatch.fnmatchcase(name, p) for p in patterns)

    converted = []
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        if hasattr(module, "patch_embed") and isinstance(getattr(module, "blocks", None), _BLOCK_LISTS):
            attentions = []
            for i, block in enumerate(module.blocks):
                attn = getattr(block, "attn", None)  # blocks without one (timm's parallel blocks) are skipped
                if isinstance(attn, VitAttention | EvaAttention | AttentionRope) and wanted(
                    f"{prefix}blocks.{i}", None
                ):
                    block.attn = _plugin(attn, head_dim, getattr(module, "num_prefix_tokens", 0))
                    attentions.append(block.attn)
                    converted.append(f"{prefix}blocks.{i}")
            if attentions:
                module.patch_embed.register_forward_pre_hook(_GridRecorder(attentions))
        match = _STAGE_BLOCK.search(name)
        if match is None or not wanted(name, int(match.group(1))):
            continue
        if isinstance(module, SwinTransformerBlock):
            module.attn = _plugin(module.attn, head_dim)  # type: ignore[assignment]  # its window attention replaced
            module.__class__ = CirculantSwinBlock
            converted.append(name)
        elif isinstance(getattr(module, "attn", None), PvtV2Attention):
            module.attn = _plugin(module.attn, head_dim)
            converted.append(name)
    if not converted:
        raise ValueError(
            f"nothing converted in {type(model).__name__}: no ViT/DeiT/EVA, Swin or PVT v2 attention block "
            f"matched {patterns or stages or 'the defaults'}"
        )
    model.circulant_blocks = converted  # type: ignore[assignment]  # a plain attribute: torch types a module's
    return model
