"""CA-DeiT: the plain (isotropic) vision transformer with circulant attention.

Matches the authors' released CA-DeiT: 16x16 conv patch embedding, no class token, no absolute
position embedding (each block's depthwise conv encodes position), circulant-attention blocks,
final LayerNorm, mean over tokens, linear head. Because nothing depends on the token count, any
input size divisible by the patch size works without retraining, non-square included.

The softmax-attention baselines ``deit_tiny/small/base_patch16_224`` are timm's own models; the
ablations of the paper's Table 5 are options of these factories (``head_dim``, ``reweight``) plus
``deit_small_reweight_patch16_224``, timm's DeiT-S with the token reweighting on softmax attention.
"""

from __future__ import annotations

from typing import Any

import timm
from timm.layers import PatchEmbed
from timm.models import generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn

from cat.layers import CirculantBlock, LayerNorm6, TokenReweightedAttention
from cat.ops.circulant import Reweight

from ._base import TimmApiMixin, build_family_model, family_cfg, run_blocks

__all__ = ["CirculantVisionTransformer"]


class CirculantVisionTransformer(TimmApiMixin, nn.Module):
    """Isotropic ViT whose blocks use circulant attention (CA-DeiT)."""

    layer_groups = {"stem": r"^patch_embed", "blocks": r"^blocks\.(\d+)"}  # timm's group_matcher

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 192,
        depth: int = 12,
        mlp_ratio: float = 4.0,
        head_dim: int = 1,
        reweight: Reweight = "post",
        drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        global_pool: str = "avg",
    ) -> None:
        super().__init__()
        if global_pool not in ("avg", ""):
            raise ValueError(f"global_pool must be 'avg' or '' (no pooling); got {global_pool!r}")
        self.num_features = self.embed_dim = embed_dim
        self.grad_checkpointing = False
        self.patch_embed = PatchEmbed(
            img_size, patch_size, in_chans, embed_dim, output_fmt="NHWC", strict_img_size=False
        )
        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # stochastic depth decay rule
        self.blocks = nn.ModuleList(
            [
                CirculantBlock(
                    embed_dim,
                    mlp_ratio=mlp_ratio,
                    head_dim=head_dim,
                    reweight=reweight,
                    proj_drop=proj_drop_rate,
                    drop_path=dpr[i],
                )
                for i in range(depth)
            ]
        )
        self.norm = LayerNorm6(embed_dim)
        self.init_head(num_classes, drop_rate, global_pool)

    def forward_features(self, x: Tensor) -> Tensor:
        """Images (B, 3, H, W) -> normalised tokens (B, N, C), N = (H / patch) * (W / patch)."""
        ph, pw = self.patch_embed.patch_size
        if x.dim() != 4 or x.shape[-2] % ph or x.shape[-1] % pw:
            raise ValueError(
                f"expected images (B, C, H, W) with H divisible by {ph} and W by {pw}; got shape {tuple(x.shape)}"
            )
        x = self.patch_embed(x)
        B, H, W, C = x.shape
        x = x.reshape(B, H * W, C)
        x = run_blocks(self.blocks, x, (H, W), self.grad_checkpointing and self.training)
        return self.norm(x)


default_cfgs = generate_default_cfgs(
    {name: family_cfg("patch_embed.proj") for name in ("ca_deit_tiny", "ca_deit_small", "ca_deit_base")}
)


def _create(variant: str, pretrained: bool, **kwargs: Any) -> CirculantVisionTransformer:
    return build_family_model(CirculantVisionTransformer, variant, pretrained, hierarchical=False, **kwargs)


# Drop path: the DeiT recipe of the paper's Table 2 (T/S/B: 0.0/0.1/0.4).
@register_model
def ca_deit_tiny(pretrained: bool = False, **kwargs: Any) -> CirculantVisionTransformer:
    return _create("ca_deit_tiny", pretrained, **{"embed_dim": 192, "depth": 12, "drop_path_rate": 0.0, **kwargs})


@register_model
def ca_deit_small(pretrained: bool = False, **kwargs: Any) -> CirculantVisionTransformer:
    return _create("ca_deit_small", pretrained, **{"embed_dim": 384, "depth": 12, "drop_path_rate": 0.1, **kwargs})


@register_model
def ca_deit_base(pretrained: bool = False, **kwargs: Any) -> CirculantVisionTransformer:
    return _create("ca_deit_base", pretrained, **{"embed_dim": 768, "depth": 12, "drop_path_rate": 0.4, **kwargs})


@register_model
def deit_small_reweight_patch16_224(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """DeiT-S whose softmax attention output is token-reweighted (``SiLU(Linear(x))``), Table 5's last row."""
    return timm.create_model(
        "deit_small_patch16_224", pretrained=pretrained, attn_layer=TokenReweightedAttention, **kwargs
    )
