"""PVT v1 (Wang et al., 2021) and CA-PVT.

timm has no PVT v1, so it is written here. Inside, the model is a list of stages (scriptable,
traceable); its state dicts carry the parameter names of the PVT v1 release (``patch_embed{s}``,
``pos_embed{s}``, ``block{s}.{j}.attn.q/.kv/.sr/.norm``, ``cls_token``, ...), so the release's
checkpoints load into the ``SSSS`` model and this project's files keep the release format.
``attn_pattern`` picks, per stage, circulant blocks (``C``), PVT's spatial-reduction attention
blocks (``S``) or a mix (``M<k>``); CA-PVT is ``CCSS``, keeping PVT's per-stage absolute position
embeddings.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from timm.layers import DropPath, Mlp, register_notrace_function, trunc_normal_
from timm.models import generate_default_cfgs, register_model
from torch import Tensor, nn

from cat.layers import CirculantBlock, LayerNorm6, init_vit_weights, parse_attn_pattern

from ._base import TimmApiMixin, build_family_model, checkpoint_blocks, family_cfg
from .loading import register_state_dict_adapter

__all__ = ["PyramidVisionTransformer", "resize_pos_embed"]


@register_notrace_function  # a leaf in FX graphs: its branch is on the input's size
def pad_to_multiple(x: Tensor, multiple: int) -> Tensor:
    """``x`` padded at the bottom and right to sides that are multiples of ``multiple``; as it is if they are."""
    pad_w, pad_h = -x.shape[-1] % multiple, -x.shape[-2] % multiple
    # Padding only where needed: torch.export's sides, multiples of the output stride, then carry no
    # padding arithmetic through the stages (its symbolic simplification took 35 s of a 45 s export).
    if pad_w or pad_h:
        x = F.pad(x, (0, pad_w, 0, pad_h))
    return x


class PatchEmbed(nn.Module):
    """Non-overlapping patch embedding; pads the bottom/right so any input size works (ceil)."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        x = self.proj(pad_to_multiple(x, self.patch_size))
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
        self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio) if sr_ratio > 1 else None
        self.norm = nn.LayerNorm(dim) if sr_ratio > 1 else None

    def forward(self, x: Tensor, hw: tuple[int, int]) -> Tensor:
        B, N, C = x.shape
        h = self.num_heads
        q = self.q(x).reshape(B, N, h, C // h).transpose(1, 2)
        if self.sr is not None and self.norm is not None:
            grid = x.transpose(1, 2).reshape(B, C, hw[0], hw[1])
            x = self.norm(self.sr(grid).flatten(2).transpose(1, 2))
        k, v = self.kv(x).reshape(B, -1, 2, h, C // h).permute(2, 0, 3, 1, 4).unbind(0)
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
    if old_hw[0] == new_hw[0] and old_hw[1] == new_hw[1]:
        return pos_embed
    prefix, grid = pos_embed[:, :num_prefix], pos_embed[:, num_prefix:]
    grid = grid.reshape(1, old_hw[0], old_hw[1], -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=new_hw, mode="bilinear", align_corners=False)
    return torch.cat([prefix, grid.flatten(2).transpose(1, 2)], dim=1)


torch.fx.wrap("resize_pos_embed")  # it branches on the grid: a leaf call for every FX tracer


class PVTStage(nn.Module):
    """Patch embedding, position embedding (resampled to the input's grid) and blocks; the last stage
    of a model with a class token carries it. Takes an NCHW map, returns tokens and their grid."""

    def __init__(
        self,
        patch_size: int,
        in_chans: int,
        dim: int,
        grid_size: tuple[int, int],
        blocks: list[nn.Module],
        cls_token: bool,
        drop_rate: float,
    ) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(patch_size, in_chans, dim)
        self.num_prefix_tokens = int(cls_token)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if cls_token else None
        self.grid_size = grid_size
        self.pos_embed = nn.Parameter(torch.zeros(1, grid_size[0] * grid_size[1] + self.num_prefix_tokens, dim))
        self.pos_drop = nn.Dropout(drop_rate)
        self.blocks = nn.ModuleList(blocks)
        self.grad_checkpointing = False

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        x, hw = self.patch_embed(x)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + resize_pos_embed(self.pos_embed, self.grid_size, hw, self.num_prefix_tokens))
        if self.grad_checkpointing and self.training and not torch.jit.is_scripting():
            return checkpoint_blocks(self.blocks, x, hw), hw
        for block in self.blocks:
            x = block(x, hw)
        return x, hw

    def grid_map(self, tokens: Tensor, hw: tuple[int, int]) -> Tensor:
        """Tokens (B, [cls +] N, C) as an NCHW map, the class token dropped."""
        tokens = tokens[:, self.num_prefix_tokens :]
        return tokens.transpose(1, 2).reshape(tokens.shape[0], -1, hw[0], hw[1])


# Internal parameter names -> the release's: stages.{s}.patch_embed -> patch_embed{s+1}, ....
_RELEASE_NAMES = (
    (re.compile(r"stages\.(\d)\.(patch_embed|pos_embed)"), lambda m: f"{m[2]}{int(m[1]) + 1}"),
    (re.compile(r"stages\.(\d)\.blocks"), lambda m: f"block{int(m[1]) + 1}"),
    (re.compile(r"stages\.3\.cls_token"), lambda m: "cls_token"),
)
_INTERNAL_NAMES = (
    (re.compile(r"(patch_embed|pos_embed)(\d)"), lambda m: f"stages.{int(m[2]) - 1}.{m[1]}"),
    (re.compile(r"block(\d)"), lambda m: f"stages.{int(m[1]) - 1}.blocks"),
    (re.compile(r"cls_token"), lambda m: "stages.3.cls_token"),
)


def _renamed(state_dict: dict[str, Tensor], prefix: str, rules: tuple) -> None:
    """Rename the keys under ``prefix`` in place by the first rule matching right after it."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        for pattern, name in rules:
            match = pattern.match(key, len(prefix))
            if match:
                state_dict[prefix + name(match) + key[match.end() :]] = state_dict.pop(key)
                break


def _to_release_names(module: nn.Module, state_dict: dict[str, Tensor], prefix: str, *_: Any) -> None:
    _renamed(state_dict, prefix, _RELEASE_NAMES)


def _to_internal_names(module: nn.Module, state_dict: dict[str, Tensor], prefix: str, *_: Any) -> None:
    _renamed(state_dict, prefix, _INTERNAL_NAMES)


class PyramidVisionTransformer(TimmApiMixin, nn.Module):
    """PVT v1 with per-stage choice of circulant or spatial-reduction attention."""

    layer_groups = {"stem": r"^stages\.0\.(?:patch|pos)_embed", "blocks": r"^stages\.(\d+)"}  # timm's group_matcher

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
        img_hw = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        patch_sizes = (4, 2, 2, 2)
        dpr = [drop_path_rate * i / max(sum(depths) - 1, 1) for i in range(sum(depths))]
        self.feature_info = []
        stages, reduction, cursor, in_ch = [], 1, 0, in_chans
        for s in range(4):
            reduction *= patch_sizes[s]
            grid = (img_hw[0] // reduction, img_hw[1] // reduction)
            cls_token = s == 3 and self.has_cls_token
            blocks: list[nn.Module] = []
            for j in range(depths[s]):
                if j < self.circulant_blocks[s]:
                    circulant = CirculantBlock(
                        embed_dims[s], mlp_ratio=mlp_ratios[s], proj_drop=proj_drop_rate, drop_path=dpr[cursor + j]
                    )
                    circulant.num_prefix_tokens = int(cls_token)  # the class token passes by circulant attention
                    blocks.append(circulant)
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
            stages.append(PVTStage(patch_sizes[s], in_ch, embed_dims[s], grid, blocks, cls_token, drop_rate))
            cursor += depths[s]
            in_ch = embed_dims[s]
            self.feature_info.append({"num_chs": embed_dims[s], "reduction": reduction, "module": f"stages.{s}"})
        self.stages = nn.ModuleList(stages)
        self.norm = LayerNorm6(embed_dims[3])
        self.init_head(num_classes, drop_rate, global_pool if self.has_cls_token else "avg", init=False)  # see below
        for stage in self.stages:
            trunc_normal_(stage.pos_embed, std=0.02)
            if stage.cls_token is not None:
                trunc_normal_(stage.cls_token, std=0.02)
        self.apply(init_vit_weights)
        self.register_state_dict_post_hook(_to_release_names)
        self.register_load_state_dict_pre_hook(_to_internal_names)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {f"stages.{s}.pos_embed" for s in range(4)} | ({"stages.3.cls_token"} if self.has_cls_token else set())

    def _stage_maps(
        self, x: Tensor, take: list[int], last: int, norm: bool, output_fmt: str
    ) -> tuple[Tensor, list[Tensor]]:
        intermediates = []
        # Each stage a PVTStage, which torch types as a Module (no cast: TorchScript compiles this).
        for s, stage in enumerate(self.stages[: last + 1]):
            tokens, hw = stage(x)
            if s in take:
                normed = self.norm(tokens) if (norm and s == 3) else tokens
                intermediates.append(stage.grid_map(normed, hw))  # type: ignore[operator]
            x = stage.grid_map(tokens, hw)  # type: ignore[operator]
        return self.norm(tokens), intermediates

    def forward_features(self, x: Tensor) -> Tensor:
        """Images -> normalised tokens of the last stage, the class token first (as timm's ViT)."""
        tokens = x
        for stage in self.stages:  # PVTStages (as in _stage_maps)
            tokens, hw = stage(x)
            x = stage.grid_map(tokens, hw)  # type: ignore[operator]
        return self.norm(tokens)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = x[:, 0] if self.global_pool == "token" else x.mean(dim=1)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)


def checkpoint_filter_fn(state_dict: dict[str, Any], model: PyramidVisionTransformer) -> dict[str, Tensor]:
    """Resize position embeddings of a checkpoint trained at another resolution to ``model``'s grids."""
    state_dict = state_dict.get("model", state_dict)
    own = model.state_dict()
    out = {}
    for k, v in state_dict.items():
        if k.startswith("pos_embed") and k in own and v.shape != own[k].shape:
            stage = cast(PVTStage, model.stages[int(k[len("pos_embed") :]) - 1])
            side = int(round((v.shape[1] - stage.num_prefix_tokens) ** 0.5))
            v = resize_pos_embed(v, (side, side), stage.grid_size, stage.num_prefix_tokens)
        out[k] = v
    return out


# pool_size: the last stage's grid. forward_features returns tokens, the class token first, as timm's
# ViT does: PVT v1 classifies through its class token, which an NCHW map cannot carry.
default_cfgs = generate_default_cfgs(
    {
        f"{prefix}pvt_{size}": family_cfg("patch_embed1.proj", pool_size=(7, 7))
        for size in ("tiny", "small", "medium", "large")
        for prefix in ("", "ca_")
    }
)


register_state_dict_adapter(PyramidVisionTransformer, checkpoint_filter_fn)


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
