"""CA-Swin: timm's Swin Transformer with circulant-attention blocks in chosen stages.

The ``S`` stages are timm's own Swin stages and blocks (shifted-window attention), so timm's Swin
checkpoints load into the ``SSSS`` model and give timm's logits. In a ``C`` stage the window
blocks are replaced by global circulant-attention blocks over the stage's whole feature map (after
timm's patch merging). Any input size works: the patch embedding pads to a multiple of 4, window
attention pads internally, and circulant attention needs no padding at all.

No ``from __future__ import annotations`` here: TorchScript compiles :func:`shifted_window_mask`
from an FX graph and reads its annotations.
"""

import math
from functools import partial
from typing import Any

import torch
from timm.layers import PatchEmbed
from timm.models import generate_default_cfgs, register_model
from timm.models.swin_transformer import SwinTransformer, SwinTransformerBlock
from timm.models.swin_transformer import checkpoint_filter_fn as timm_swin_filter
from torch import Tensor

from cat.layers import CirculantBlockNHWC, parse_attn_pattern

from ._base import build_family_model, family_cfg
from .loading import register_state_dict_adapter

__all__ = ["CirculantSwinTransformer"]


def shifted_window_mask(x: Tensor, window: tuple[int, int], shift: tuple[int, int]) -> Tensor:
    """The additive attention mask of shifted windows over ``x`` (B, H, W, C), H and W multiples of
    ``window``: (windows, N, N), 0 between tokens from the same region of the rolled map, -100
    between tokens the roll brought together from opposite borders."""
    H, W = x.shape[1], x.shape[2]
    rows = torch.arange(H, device=x.device)
    cols = torch.arange(W, device=x.device)
    # Along each axis three regions: before the last window, the last window before the shift, the shift.
    row_region = (rows >= H - window[0]).long() + (rows >= H - shift[0]).long()
    col_region = (cols >= W - window[1]).long() + (cols >= W - shift[1]).long()
    regions = row_region[:, None] * 3 + col_region[None, :]
    windows = regions.view(H // window[0], window[0], W // window[1], window[1]).permute(0, 2, 1, 3)
    windows = windows.reshape(-1, window[0] * window[1])
    apart = windows[:, None, :] != windows[:, :, None]
    return torch.zeros(apart.shape, dtype=x.dtype, device=x.device).masked_fill(apart, -100.0)


# CA-Swin takes any input size, so its window blocks build their masks per input; timm builds them by
# slice assignment, which FX cannot trace. As one leaf call (as timm's notrace functions) the traced
# graph holds the computation and serves every size; TorchScript compiles it.
torch.fx.wrap("shifted_window_mask")


class TraceableWindowBlock(SwinTransformerBlock):
    """timm's Swin block whose per-input mask is one FX leaf call (:func:`shifted_window_mask`)."""

    def get_attn_mask(
        self, x: Tensor | None = None, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> Tensor | None:
        if not (self.shift_size[0] or self.shift_size[1]):
            return None
        if x is None:  # a fixed input size: the mask of its padded grid, once
            # timm's block holds its resolution as a pair (no cast: TorchScript compiles this)
            H = math.ceil(self.input_resolution[0] / self.window_size[0]) * self.window_size[0]  # type: ignore[index]
            W = math.ceil(self.input_resolution[1] / self.window_size[1]) * self.window_size[1]  # type: ignore[index]
            x = torch.zeros((1, H, W, 1), device=device, dtype=dtype)
        return shifted_window_mask(x, self.window_size, self.shift_size)


class CirculantSwinTransformer(SwinTransformer):
    """Swin with ``attn_pattern`` choosing circulant (``C``), window (``S``) or mixed (``M<k>``) stages."""

    def __init__(self, attn_pattern: str = "CCSS", strict_img_size: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("embed_layer", partial(PatchEmbed, dynamic_img_pad=not strict_img_size))
        super().__init__(strict_img_size=strict_img_size, **kwargs)
        self.attn_pattern = attn_pattern
        stages: list[Any] = list(self.layers)  # timm's SwinTransformerStage, each with its blocks
        depths = [len(stage.blocks) for stage in stages]
        mlp_ratio = kwargs.get("mlp_ratio", 4.0)
        for stage, num_circulant in zip(stages, parse_attn_pattern(attn_pattern, depths), strict=True):
            for j in range(num_circulant):
                old = stage.blocks[j]
                stage.blocks[j] = CirculantBlockNHWC(
                    old.norm1.normalized_shape[0],
                    mlp_ratio=mlp_ratio,
                    drop_path=getattr(old.drop_path1, "drop_prob", 0.0),
                    proj_drop=kwargs.get("proj_drop_rate", 0.0),
                )
            for block in stage.blocks[num_circulant:]:
                if getattr(block, "dynamic_mask", False):
                    block.__class__ = TraceableWindowBlock  # the same block and weights, traceable


def _cfg(**kwargs: Any) -> dict[str, Any]:
    swin = {"classifier": "head.fc", "pool_size": (7, 7), "crop_pct": 0.9, "license": "mit"}
    return family_cfg("patch_embed.proj", **{**swin, **kwargs})


default_cfgs = generate_default_cfgs(
    {
        "ca_swin_tiny": _cfg(),
        "ca_swin_small": _cfg(),
        "ca_swin_base": _cfg(),
        "ca_swin_base_384": _cfg(input_size=(3, 384, 384), pool_size=(12, 12), crop_pct=1.0),
    }
)


def _create(variant: str, pretrained: bool, **kwargs: Any) -> CirculantSwinTransformer:
    return build_family_model(
        CirculantSwinTransformer, variant, pretrained, pretrained_filter_fn=timm_swin_filter, **kwargs
    )


_TINY = {"embed_dim": 96, "depths": (2, 2, 6, 2), "num_heads": (3, 6, 12, 24), "drop_path_rate": 0.2}
_SMALL = {"embed_dim": 96, "depths": (2, 2, 18, 2), "num_heads": (3, 6, 12, 24), "drop_path_rate": 0.3}
_BASE = {"embed_dim": 128, "depths": (2, 2, 18, 2), "num_heads": (4, 8, 16, 32), "drop_path_rate": 0.5}


register_state_dict_adapter(SwinTransformer, timm_swin_filter)  # relative-position tables resized


@register_model
def ca_swin_tiny(pretrained: bool = False, **kwargs: Any) -> CirculantSwinTransformer:
    """CA-Swin-T: Swin-T with circulant attention in the first two stages (``attn_pattern='SSSS'``: Swin-T)."""
    return _create("ca_swin_tiny", pretrained, **{"window_size": 7, **_TINY, **kwargs})


@register_model
def ca_swin_small(pretrained: bool = False, **kwargs: Any) -> CirculantSwinTransformer:
    return _create("ca_swin_small", pretrained, **{"window_size": 7, **_SMALL, **kwargs})


@register_model
def ca_swin_base(pretrained: bool = False, **kwargs: Any) -> CirculantSwinTransformer:
    return _create("ca_swin_base", pretrained, **{"window_size": 7, **_BASE, **kwargs})


@register_model
def ca_swin_base_384(pretrained: bool = False, **kwargs: Any) -> CirculantSwinTransformer:
    return _create("ca_swin_base_384", pretrained, **{"img_size": 384, "window_size": 12, **_BASE, **kwargs})
