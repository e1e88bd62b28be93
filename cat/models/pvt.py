"""PVT v1 (Wang et al., 2021) and CA-PVT.

timm has no PVT v1, so it is written here with the parameter names of the PVT v1 release
(``patch_embed{s}``, ``pos_embed{s}``, ``block{s}.{j}.attn.q/.kv/.sr/.norm``, ``cls_token``, ...), so
its checkpoints load into the ``SSSS`` model. ``attn_pattern`` picks, per stage, circulant blocks
(``C``), PVT's spatial-reduction attention blocks (``S``) or a mix (``M<k>``); CA-PVT is ``CCSS``,
keeping PVT's per-stage absolute position embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import DropPath, Mlp, trunc_normal_
from timm.models import generate_default_cfgs, register_model
from torch import Tensor, nn

from cat.layers import CirculantBlock, LayerNorm6, init_vit_weights, parse_attn_pattern

from ._base import TimmApiMixin, build_family_model, family_cfg, run_blocks

__all__ = ["PyramidVisionTransformer", "resize_pos_embed"]


class PatchEmbed(nn.Module):
    """Non-overlapping patch embedding; pads the bottom/right so any input size works (ceil)."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        p = self.patch_size
        x = F.pad(x, (0, -x.shape[-1] % p, 0, -x.shape[-2] % p))
        x = self.proj(x)
        hw = (x.shape[-2], x.shape[-1])
        return self.norm(x.flatten(2).transpose(1, 2)), hw


class SpatialReductionAttention(nn.Module):
    """PVT's attention: keys and values from a strided-conv-reduced token map."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        sr_ratio: int = 1,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} must be divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.sr_ratio = sr_ratio
        self.attn_drop = attn_drop
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        if sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio)
            self.norm = nn.LayerNorm(dim)

    def forward(self, x: Tensor, hw: tuple[int, int]) -> Tensor:
        B, N, C = x.shape
        h = self.num_heads
        q = self.q(x).reshape(B, N, h, C // h).transpose(1, 2)
        if self.sr_ratio > 1:
            grid = x.transpose(1, 2).reshape(B, C, *hw)
            x = self.norm(self.sr(grid).flatten(2).transpose(1, 2))
        k, v = self.kv(x).reshape(B, -1, 2, h, C // h).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.0)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C)))


class PVTBlock(nn.Module):
    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float,
        qkv_bias: bool,
        sr_ratio: int,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        self.norm1 = LayerNorm6(dim)
        self.attn = SpatialReductionAttention(dim, num_heads, qkv_bias, sr_ratio, attn_drop, proj_drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = LayerNorm6(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=proj_drop)

    def forward(self, x: Tensor, hw: tuple[int, int]) -> Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), hw))
        return x + self.drop_path(self.mlp(self.norm2(x)))


def resize_pos_embed(
    pos_embed: Tensor, old_hw: tuple[int, int], new_hw: tuple[int, int], num_prefix: int = 0
) -> Tensor:
    """Bilinearly resample a (1, prefix + H*W, C) position embedding to another grid."""
    if tuple(old_hw) == tuple(new_hw):
        return pos_embed
    prefix, grid = pos_embed[:, :num_prefix], pos_embed[:, num_prefix:]
    grid = grid.reshape(1, *old_hw, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=new_hw, mode="bilinear", align_corners=False)
    return torch.cat([prefix, grid.flatten(2).transpose(1, 2)], dim=1)


def _bypass_class_token(block: CirculantBlock, x: Tensor, hw: tuple[int, int]) -> Tensor:
    # Circulant attention runs on the token grid; the class token passes by it.
    return torch.cat([x[:, :1], block(x[:, 1:], hw)], dim=1)


class PyramidVisionTransformer(TimmApiMixin, nn.Module):
    """PVT v1 with per-stage choice of circulant or spatial-reduction attention."""

    layer_groups = {
        "stem": r"^cls_token|^pos_embed1|^patch_embed1",
        "blocks": r"^(?:block|patch_embed|pos_embed)(\d+)",
    }  # timm's group_matcher

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dims: Sequence[int] = (64, 128, 320, 512),
        num_heads: Sequence[int] = (1, 2, 5, 8),
        mlp_ratios: Sequence[float] = (8, 8, 4, 4),
        qkv_bias: bool = True,
        depths: Sequence[int] = (2, 2, 2, 2),
        sr_ratios: Sequence[int] = (8, 4, 2, 1),
        attn_pattern: str = "SSSS",
        drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.1,
        global_pool: str = "token",
    ) -> None:
        super().__init__()
        self.depths = tuple(depths)
        self.embed_dims = tuple(embed_dims)
        self.num_features = self.head_hidden_size = embed_dims[-1]
        self.attn_pattern = attn_pattern
        self.circulant_blocks = parse_attn_pattern(attn_pattern, depths)
        # The class token lives in the last stage; a fully circulant last stage has no place for it.
        self.has_cls_token = self.circulant_blocks[-1] < depths[-1]
        self.grad_checkpointing = False
        img_hw = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        patch_sizes = (4, 2, 2, 2)
        dpr = [drop_path_rate * i / max(sum(depths) - 1, 1) for i in range(sum(depths))]
        self.feature_info = []
        self.grid_sizes = []
        reduction, cursor, in_ch = 1, 0, in_chans
        for s in range(4):
            reduction *= patch_sizes[s]
            grid = (img_hw[0] // reduction, img_hw[1] // reduction)
            self.grid_sizes.append(grid)
            prefix = 1 if (s == 3 and self.has_cls_token) else 0
            setattr(self, f"patch_embed{s + 1}", PatchEmbed(patch_sizes[s], in_ch, embed_dims[s]))
            setattr(self, f"pos_embed{s + 1}", nn.Parameter(torch.zeros(1, grid[0] * grid[1] + prefix, embed_dims[s])))
            blocks = []
            for j in range(depths[s]):
                if j < self.circulant_blocks[s]:
                    blocks.append(
                        CirculantBlock(
                            embed_dims[s], mlp_ratio=mlp_ratios[s], proj_drop=proj_drop_rate, drop_path=dpr[cursor + j]
                        )
                    )
                else:
                    blocks.append(
                        PVTBlock(
                            embed_dims[s],
                            num_heads[s],
                            mlp_ratios[s],
                            qkv_bias,
                            sr_ratios[s],
                            proj_drop_rate,
                            attn_drop_rate,
                            dpr[cursor + j],
                        )
                    )
            setattr(self, f"block{s + 1}", nn.ModuleList(blocks))
            cursor += depths[s]
            in_ch = embed_dims[s]
            self.feature_info.append({"num_chs": embed_dims[s], "reduction": reduction, "module": f"block{s + 1}"})
        self.pos_drop = nn.Dropout(drop_rate)
        if self.has_cls_token:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dims[3]))
        self.norm = LayerNorm6(embed_dims[3])
        self.init_head(num_classes, drop_rate, global_pool if self.has_cls_token else "avg", init=False)  # see below
        for s in range(4):
            trunc_normal_(getattr(self, f"pos_embed{s + 1}"), std=0.02)
        if self.has_cls_token:
            trunc_normal_(self.cls_token, std=0.02)
        self.apply(init_vit_weights)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {f"pos_embed{s + 1}" for s in range(4)} | ({"cls_token"} if self.has_cls_token else set())

    def _stage(self, s: int, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Stage s (0-based) on an NCHW map; returns tokens (B, [cls +] N, C) and the grid."""
        x, hw = getattr(self, f"patch_embed{s + 1}")(x)
        prefix = 1 if (s == 3 and self.has_cls_token) else 0
        if prefix:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        pos = resize_pos_embed(getattr(self, f"pos_embed{s + 1}"), self.grid_sizes[s], hw, prefix)
        x = self.pos_drop(x + pos)
        blocks = [
            partial(_bypass_class_token, blk) if prefix and isinstance(blk, CirculantBlock) else blk
            for blk in getattr(self, f"block{s + 1}")
        ]
        return run_blocks(blocks, x, hw, self.grad_checkpointing and self.training), hw

    def _grid_map(self, s: int, x: Tensor, hw: tuple[int, int]) -> Tensor:
        if s == 3 and self.has_cls_token:
            x = x[:, 1:]
        return x.transpose(1, 2).reshape(x.shape[0], -1, *hw)

    def _stage_maps(self, x: Tensor, take: list[int], last: int, norm: bool) -> tuple[Tensor, list[Tensor]]:
        intermediates = []
        for s in range(last + 1):
            tokens, hw = self._stage(s, x)
            if s in take:
                out = self.norm(tokens) if (norm and s == 3) else tokens
                intermediates.append(self._grid_map(s, out, hw))
            if s < 3:
                x = self._grid_map(s, tokens, hw)
        return self.norm(tokens), intermediates

    def forward_features(self, x: Tensor) -> Tensor:
        for s in range(4):
            tokens, hw = self._stage(s, x)
            if s < 3:
                x = self._grid_map(s, tokens, hw)
        return self.norm(tokens)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = x[:, 0] if self.global_pool == "token" else x.mean(dim=1)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)


def checkpoint_filter_fn(state_dict: dict[str, Tensor], model: PyramidVisionTransformer) -> dict[str, Tensor]:
    """Resize position embeddings of a checkpoint trained at another resolution to ``model``'s grids."""
    state_dict = state_dict.get("model", state_dict)
    out = {}
    for k, v in state_dict.items():
        if k.startswith("pos_embed") and k in model.state_dict() and v.shape != model.state_dict()[k].shape:
            s = int(k[len("pos_embed") :]) - 1
            prefix = 1 if (s == 3 and model.has_cls_token) else 0
            side = int(round((v.shape[1] - prefix) ** 0.5))
            v = resize_pos_embed(v, (side, side), model.grid_sizes[s], prefix)
        out[k] = v
    return out


default_cfgs = generate_default_cfgs(
    {
        f"{prefix}pvt_{size}": family_cfg("patch_embed1.proj")
        for size in ("tiny", "small", "medium", "large")
        for prefix in ("", "ca_")
    }
)


def _create(variant: str, pretrained: bool, **kwargs: Any) -> PyramidVisionTransformer:
    return build_family_model(
        PyramidVisionTransformer, variant, pretrained, pretrained_filter_fn=checkpoint_filter_fn, **kwargs
    )


# Depths and drop path of the published PVT v1 recipes; CA-PVT is the same model with attn_pattern CCSS.
_TINY = {"depths": (2, 2, 2, 2), "drop_path_rate": 0.1}
_SMALL = {"depths": (3, 4, 6, 3), "drop_path_rate": 0.1}
_MEDIUM = {"depths": (3, 4, 18, 3), "drop_path_rate": 0.3}
_LARGE = {"depths": (3, 8, 27, 3), "drop_path_rate": 0.3}


@register_model
def pvt_tiny(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    return _create("pvt_tiny", pretrained, **{**_TINY, "attn_pattern": "SSSS", **kwargs})


@register_model
def pvt_small(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    return _create("pvt_small", pretrained, **{**_SMALL, "attn_pattern": "SSSS", **kwargs})


@register_model
def pvt_medium(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    return _create("pvt_medium", pretrained, **{**_MEDIUM, "attn_pattern": "SSSS", **kwargs})


@register_model
def pvt_large(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    return _create("pvt_large", pretrained, **{**_LARGE, "attn_pattern": "SSSS", **kwargs})


@register_model
def ca_pvt_tiny(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """CA-PVT-T: circulant attention in stages 1-2 (``attn_pattern='SSSS'`` is PVT-T)."""
    return _create("ca_pvt_tiny", pretrained, **{**_TINY, "attn_pattern": "CCSS", **kwargs})


@register_model
def ca_pvt_small(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    return _create("ca_pvt_small", pretrained, **{**_SMALL, "attn_pattern": "CCSS", **kwargs})


@register_model
def ca_pvt_medium(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    return _create("ca_pvt_medium", pretrained, **{**_MEDIUM, "attn_pattern": "CCSS", **kwargs})


@register_model
def ca_pvt_large(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    return _create("ca_pvt_large", pretrained, **{**_LARGE, "attn_pattern": "CCSS", **kwargs})
