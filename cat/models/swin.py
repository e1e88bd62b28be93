"""CA-Swin: timm's Swin Transformer with circulant-attention blocks in chosen stages.

The ``S`` stages are timm's own Swin stages and blocks (shifted-window attention), so timm's Swin
checkpoints load into the ``SSSS`` model and give timm's logits. In a ``C`` stage the window
blocks are replaced by global circulant-attention blocks over the stage's whole feature map (after
timm's patch merging). Any input size works: the patch embedding pads to a multiple of 4, window
attention pads internally, and circulant attention needs no padding at all.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from timm.layers import PatchEmbed
from timm.models import generate_default_cfgs, register_model
from timm.models.swin_transformer import SwinTransformer
from timm.models.swin_transformer import checkpoint_filter_fn as timm_swin_filter

from cat.layers import CirculantBlockNHWC, parse_attn_pattern

from ._base import build_family_model, family_cfg

__all__ = ["CirculantSwinTransformer"]


class CirculantSwinTransformer(SwinTransformer):
    """Swin with ``attn_pattern`` choosing circulant (``C``), window (``S``) or mixed (``M<k>``) stages."""

    def __init__(self, attn_pattern: str = "CCSS", strict_img_size: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("embed_layer", partial(PatchEmbed, dynamic_img_pad=not strict_img_size))
        super().__init__(strict_img_size=strict_img_size, **kwargs)
        self.attn_pattern = attn_pattern
        depths = [len(stage.blocks) for stage in self.layers]
        mlp_ratio = kwargs.get("mlp_ratio", 4.0)
        for stage, num_circulant in zip(self.layers, parse_attn_pattern(attn_pattern, depths), strict=True):
            for j in range(num_circulant):
                old = stage.blocks[j]
                stage.blocks[j] = CirculantBlockNHWC(
                    old.norm1.normalized_shape[0],
                    mlp_ratio=mlp_ratio,
                    drop_path=getattr(old.drop_path1, "drop_prob", 0.0),
                    proj_drop=kwargs.get("proj_drop_rate", 0.0),
                )


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
