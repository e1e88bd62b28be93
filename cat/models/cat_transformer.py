"""CAT (Circulant Attention Transformer), the paper's own hierarchical family.

The paper's appendix with CAT's exact design is not available to us, so this is a reconstruction
in the spirit of the same lab's MLLA design, stated here so nobody mistakes it for the released
architecture:

* convolutional stem to stride 4: 3x3 stride-2 conv -> C/2, BN, ReLU; a residual pair of 3x3
  convs with BN; 3x3 stride-2 conv -> 4C, BN, ReLU; 1x1 conv -> C, BN;
* between stages: 1x1 conv -> 8 C_in, ReLU; depthwise 3x3 stride-2 conv, ReLU; 1x1 conv -> 2 C_in, BN;
* circulant-attention blocks in all four stages (depthwise-conv position encoding, LN, circulant
  attention with the SiLU gate, LN, GELU MLP ratio 4); dims double per stage;
* head: LN, average pool, linear.

Strided 3x3 convs with padding 1 give ceil(H/2) x ceil(W/2), so any input size works.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from timm.models import generate_default_cfgs, register_model
from torch import Tensor, nn

from cat.layers import CirculantBlock, LayerNorm6

from ._base import TimmApiMixin, build_family_model, checkpoint_blocks, family_cfg

__all__ = ["CirculantAttentionTransformer"]


def conv_bn(in_ch: int, out_ch: int, kernel: int, stride: int = 1, groups: int = 1, relu: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(in_ch, out_ch, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(out_ch),
    ]
    if relu:
        layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class Stem(nn.Module):
    """Convolutional stem to stride 4."""

    def __init__(self, in_chans: int, dim: int) -> None:
        super().__init__()
        self.conv1 = conv_bn(in_chans, dim // 2, 3, stride=2)
        self.residual = nn.Sequential(conv_bn(dim // 2, dim // 2, 3), conv_bn(dim // 2, dim // 2, 3, relu=False))
        self.conv2 = nn.Sequential(conv_bn(dim // 2, 4 * dim, 3, stride=2), conv_bn(4 * dim, dim, 1, relu=False))

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv1(x)
        x = x + self.residual(x)
        return self.conv2(x)


class Downsample(nn.Module):
    """Inverted-bottleneck stride-2 downsampling between stages (C -> 2C)."""

    def __init__(self, dim: int, expansion: int = 8) -> None:
        super().__init__()
        hidden = expansion * dim
        self.expand = nn.Sequential(nn.Conv2d(dim, hidden, 1), nn.ReLU(inplace=True))
        self.dw = nn.Sequential(nn.Conv2d(hidden, hidden, 3, 2, 1, groups=hidden), nn.ReLU(inplace=True))
        self.project = conv_bn(hidden, 2 * dim, 1, relu=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.project(self.dw(self.expand(x)))


class CATStage(nn.Module):
    def __init__(self, dim: int, depth: int, mlp_ratio: float, drop_path: Sequence[float], downsample: bool) -> None:
        super().__init__()
        # Channels-last like the previous stage's output (a view of its tokens), as CirculantBlock's cpe.
        self.downsample = Downsample(dim // 2).to(memory_format=torch.channels_last) if downsample else nn.Identity()
        self.blocks = nn.ModuleList(CirculantBlock(dim, mlp_ratio=mlp_ratio, drop_path=dp) for dp in drop_path)
        self.grad_checkpointing = False

    def forward(self, x: Tensor) -> Tensor:
        """NCHW in, NCHW out."""
        x = self.downsample(x)
        B, C, H, W = x.shape
        tokens = x.flatten(2).transpose(1, 2).contiguous()  # token-major memory, as in CA-DeiT's _tokens
        if self.grad_checkpointing and self.training and not torch.jit.is_scripting():
            tokens = checkpoint_blocks(self.blocks, tokens, (H, W))
        else:
            for block in self.blocks:
                tokens = block(tokens, (H, W))
        return tokens.transpose(1, 2).reshape(B, C, H, W)


class CirculantAttentionTransformer(TimmApiMixin, nn.Module):
    layer_groups = {"stem": r"^stem", "blocks": r"^stages\.(\d+)"}  # timm's group_matcher

    def __init__(
        self,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 64,
        depths: Sequence[int] = (2, 4, 8, 4),
        mlp_ratio: float = 4.0,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.2,
        global_pool: str = "avg",
        img_size: Any = None,
    ) -> None:
        # img_size is accepted for a uniform factory signature; nothing depends on it.
        super().__init__()
        dims = [embed_dim * 2**i for i in range(len(depths))]
        self.num_features = self.head_hidden_size = dims[-1]
        self.stem = Stem(in_chans, embed_dim)
        dpr = [drop_path_rate * i / max(sum(depths) - 1, 1) for i in range(sum(depths))]
        stages, cursor = [], 0
        self.feature_info = []
        for i, (dim, depth) in enumerate(zip(dims, depths, strict=True)):
            stages.append(CATStage(dim, depth, mlp_ratio, dpr[cursor : cursor + depth], downsample=i > 0))
            cursor += depth
            self.feature_info.append({"num_chs": dim, "reduction": 4 * 2**i, "module": f"stages.{i}"})
        self.stages = nn.Sequential(*stages)
        self.norm = LayerNorm6(dims[-1])
        self.init_head(num_classes, drop_rate, global_pool)

    def _stage_maps(
        self, x: Tensor, take: list[int], last: int, norm: bool, output_fmt: str
    ) -> tuple[Tensor, list[Tensor]]:
        x = self.stem(x)
        intermediates = []
        for i, stage in enumerate(self.stages[: last + 1]):
            x = stage(x)
            if i in take:
                intermediates.append(self._norm_map(x) if (norm and i == len(self.stages) - 1) else x)
        return self._norm_map(x), intermediates

    def _norm_map(self, x: Tensor) -> Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    def forward_features(self, x: Tensor) -> Tensor:
        """Images -> the last stage's normalised map (B, C, H/32, W/32), like timm's pvt_v2."""
        return self._norm_map(self.stages(self.stem(x)))

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=(2, 3))
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)


default_cfgs = generate_default_cfgs(
    {name: family_cfg("stem.conv1.0", pool_size=(7, 7), crop_pct=0.9) for name in ("cat_tiny", "cat_small", "cat_base")}
)


@register_model
def cat_tiny(pretrained: bool = False, **kwargs: Any) -> CirculantAttentionTransformer:
    args = {"embed_dim": 64, "depths": (2, 4, 8, 4), "drop_path_rate": 0.2, **kwargs}
    return build_family_model(CirculantAttentionTransformer, "cat_tiny", pretrained, **args)


@register_model
def cat_small(pretrained: bool = False, **kwargs: Any) -> CirculantAttentionTransformer:
    args = {"embed_dim": 64, "depths": (3, 6, 21, 6), "drop_path_rate": 0.3, **kwargs}
    return build_family_model(CirculantAttentionTransformer, "cat_small", pretrained, **args)


@register_model
def cat_base(pretrained: bool = False, **kwargs: Any) -> CirculantAttentionTransformer:
    args = {"embed_dim": 96, "depths": (3, 6, 21, 6), "drop_path_rate": 0.5, **kwargs}
    return build_family_model(CirculantAttentionTransformer, "cat_base", pretrained, **args)
