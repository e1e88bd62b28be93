"""CA-DeiT: the plain (isotropic) vision transformer with circulant attention.

Matches the authors' released CA-DeiT: 16x16 conv patch embedding, no class token, no absolute
position embedding (each block's depthwise conv encodes position), circulant-attention blocks,
final LayerNorm, mean over tokens, linear head. Because nothing depends on the token count, any
input size divisible by the patch size works without retraining, non-square included.

The softmax-attention baselines ``deit_tiny/small/base_patch16_224`` are timm's own models.
"""
from __future__ import annotations

from typing import Any

import torch
from timm.layers import PatchEmbed
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from cat.layers import CirculantBlock, LayerNorm6, init_vit_weights
from cat.models._base import ClassifierMixin
from cat.ops.circulant import Reweight

__all__ = ["CirculantVisionTransformer"]


class CirculantVisionTransformer(ClassifierMixin, nn.Module):
    """Isotropic ViT whose blocks use circulant attention (CA-DeiT)."""

    def __init__(self, img_size: int | tuple[int, int] = 224, patch_size: int = 16, in_chans: int = 3,
                 num_classes: int = 1000, embed_dim: int = 192, depth: int = 12, mlp_ratio: float = 4.0,
                 head_dim: int = 1, reweight: Reweight = "post", drop_rate: float = 0.0,
                 proj_drop_rate: float = 0.0, drop_path_rate: float = 0.0, global_pool: str = "avg") -> None:
        super().__init__()
        if global_pool not in ("avg", ""):
            raise ValueError(f"global_pool must be 'avg' or '' (no pooling); got {global_pool!r}")
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.embed_dim = embed_dim
        self.grad_checkpointing = False
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, output_fmt="NHWC",
                                      strict_img_size=False)
        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # stochastic depth decay rule
        self.blocks = nn.ModuleList([
            CirculantBlock(embed_dim, mlp_ratio=mlp_ratio, head_dim=head_dim, reweight=reweight,
                           proj_drop=proj_drop_rate, drop_path=dpr[i])
            for i in range(depth)
        ])
        self.norm = LayerNorm6(embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        init_vit_weights(self.head)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        # No parameter beyond norms and biases (which the optimizer factory already skips) is exempt.
        return set()

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return {"stem": r"^patch_embed", "blocks": [(r"^blocks\.(\d+)", None), (r"^norm", (99999,))]}

    def forward_features(self, x: Tensor) -> Tensor:
        """Images (B, 3, H, W) -> normalised tokens (B, N, C), N = (H / patch) * (W / patch)."""
        ph, pw = self.patch_embed.patch_size
        if x.dim() != 4 or x.shape[-2] % ph or x.shape[-1] % pw:
            raise ValueError(f"expected images (B, C, H, W) with H divisible by {ph} and W by {pw}; "
                             f"got shape {tuple(x.shape)}")
        x = self.patch_embed(x)
        B, H, W, C = x.shape
        x = x.reshape(B, H * W, C)
        for blk in self.blocks:
            if self.grad_checkpointing and self.training and not torch.jit.is_scripting():
                x = checkpoint(blk, x, (H, W), use_reentrant=False)
            else:
                x = blk(x, (H, W))
        return self.norm(x)


def _cfg(**kwargs: Any) -> dict[str, Any]:
    # No download URLs: weights are loaded from local files with cat.create_model(checkpoint=...).
    return {
        "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": None, "crop_pct": 0.875,
        "interpolation": "bicubic", "fixed_input_size": False, "mean": (0.485, 0.456, 0.406),
        "std": (0.229, 0.224, 0.225), "first_conv": "patch_embed.proj", "classifier": "head",
        "license": "apache-2.0", **kwargs,
    }


default_cfgs = generate_default_cfgs({
    "ca_deit_tiny": _cfg(),
    "ca_deit_small": _cfg(),
    "ca_deit_base": _cfg(),
})


def _create(variant: str, pretrained: bool, **kwargs: Any) -> CirculantVisionTransformer:
    if kwargs.get("features_only"):
        raise ValueError(f"{variant} is isotropic and has no multi-scale features; use forward_features")
    return build_model_with_cfg(CirculantVisionTransformer, variant, pretrained, **kwargs)


@register_model
def ca_deit_tiny(pretrained: bool = False, **kwargs: Any) -> CirculantVisionTransformer:
    return _create("ca_deit_tiny", pretrained, **{"embed_dim": 192, "depth": 12, **kwargs})


@register_model
def ca_deit_small(pretrained: bool = False, **kwargs: Any) -> CirculantVisionTransformer:
    return _create("ca_deit_small", pretrained, **{"embed_dim": 384, "depth": 12, **kwargs})


@register_model
def ca_deit_base(pretrained: bool = False, **kwargs: Any) -> CirculantVisionTransformer:
    return _create("ca_deit_base", pretrained, **{"embed_dim": 768, "depth": 12, **kwargs})
