"""CA-DeiT: the plain (isotropic) vision transformer with circulant attention.

Matches the authors' released CA-DeiT: 16x16 conv patch embedding, no class token, no absolute
position embedding (each block's depthwise conv encodes position), circulant-attention blocks,
final LayerNorm, mean over tokens, linear head. Because nothing depends on the token count, any
input size divisible by the patch size works without retraining, non-square included.

The softmax-attention baselines ``deit_tiny/small/base_patch16_224`` are timm's own models; the
ablations of the paper's Table 5 are options of these factories (``head_dim``, ``reweight``) plus
``deit_small_reweight_patch16_224``, timm's DeiT-S with the token reweighting on softmax attention.

No ``from __future__ import annotations`` here: TorchScript reads :func:`check_patch_grid`'s
annotations when it scripts an FX graph holding that leaf call.
"""

import urllib.error
from typing import Any, cast

import timm
import torch
from timm.layers import PatchEmbed
from timm.models import generate_default_cfgs, register_model
from timm.models._features import feature_take_indices
from timm.models.vision_transformer import VisionTransformer
from timm.models.vision_transformer import checkpoint_filter_fn as vit_filter
from torch import Tensor, nn

from cat.errors import CheckpointError
from cat.layers import CirculantBlock, LayerNorm6, TokenReweightedAttention
from cat.ops.circulant import Reweight

from ._base import TimmApiMixin, build_family_model, checkpoint_blocks, family_cfg
from .loading import load_pretrained_file, register_state_dict_adapter

__all__ = ["CirculantVisionTransformer"]


register_state_dict_adapter(VisionTransformer, vit_filter)  # timm's: position embeddings resampled


@torch.jit.ignore  # a Python call in TorchScript (an FX graph scripted holds this leaf call)
def check_patch_grid(x: Tensor, patch_size: tuple[int, int]) -> Tensor:
    """``x`` itself, once it is a batch of images whose sides are multiples of ``patch_size``."""
    if x.dim() != 4 or x.shape[-2] % patch_size[0] or x.shape[-1] % patch_size[1]:
        raise ValueError(
            f"expected images (B, C, H, W) with H divisible by {patch_size[0]} and W by {patch_size[1]}; "
            f"got shape {tuple(x.shape)}"
        )
    return x


# A check on the input's shape: a leaf call for every FX tracer, which cannot branch on shapes.
torch.fx.wrap("check_patch_grid")


class CirculantVisionTransformer(TimmApiMixin, nn.Module):
    """Isotropic ViT whose blocks use circulant attention (CA-DeiT)."""

    layer_groups = {"stem": r"^patch_embed", "blocks": r"^blocks\.(\d+)"}  # timm's group_matcher
    intermediate_formats = ("NCHW", "NLC")

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
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
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
        # Every block gives a stride-16 map, as in timm's VisionTransformer (dense heads, features_only).
        self.feature_info = [
            {"num_chs": embed_dim, "reduction": patch_size, "module": f"blocks.{i}"} for i in range(depth)
        ]
        self.init_head(num_classes, drop_rate, global_pool)

    @torch.jit.ignore
    def load_pretrained(self, path: str) -> None:
        """timm's hook for ``pretrained=True``: the release file through cat's safe loader (it
        pickles a yacs config, which timm's weights-only reader refuses)."""
        load_pretrained_file(self, path)

    def _tokens(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        if not torch.jit.is_scripting():  # TorchScript cannot format the message
            x = check_patch_grid(x, self.patch_embed.patch_size)
        x = self.patch_embed(x)
        B, H, W, C = x.shape
        # The patch embedding's NHWC is a permuted view of its conv's NCHW output. Copied once here: the residual
        # stream keeps its input's layout, and every block's LayerNorm and linear layers would copy it again.
        return x.reshape(B, H * W, C).contiguous(), (H, W)

    def forward_features(self, x: Tensor) -> Tensor:
        """Images (B, 3, H, W) -> normalised tokens (B, N, C), N = (H / patch) * (W / patch)."""
        x, hw = self._tokens(x)
        if self.grad_checkpointing and self.training and not torch.jit.is_scripting():
            x = checkpoint_blocks(self.blocks, x, hw)
        else:
            for block in self.blocks:
                x = block(x, hw)
        return self.norm(x)

    def _stage_maps(
        self, x: Tensor, take: list[int], last: int, norm: bool, output_fmt: str
    ) -> tuple[Tensor, list[Tensor]]:
        """Every block is a stage here (timm's ViT): stride-16 maps (NCHW) or tokens (NLC), each
        normalised with ``norm``."""
        x, hw = self._tokens(x)
        B, N, C = x.shape
        intermediates = []
        checkpointed = self.grad_checkpointing and self.training and not torch.jit.is_scripting()
        for i, block in enumerate(self.blocks[: last + 1]):
            x = checkpoint_blocks([block], x, hw) if checkpointed else block(x, hw)
            if i in take:
                y = self.norm(x) if norm else x
                intermediates.append(y.transpose(1, 2).reshape(B, C, *hw) if output_fmt == "NCHW" else y)
        return self.norm(x), intermediates

    def prune_intermediate_layers(
        self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Keep the blocks up to the last of ``indices``; drop the head and, optionally, the final norm."""
        take, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: max_index + 1]
        super().prune_intermediate_layers(indices, prune_norm, prune_head)
        return take


# The authors' ImageNet-1K weights (README of LeapLabTHU/Circulant-Attention). The links carry no
# file name, so the cache name is given; timm downloads into its cache and calls load_pretrained.
RELEASE_URLS = {
    "ca_deit_tiny": "https://cloud.tsinghua.edu.cn/f/51b342f641b440a9ad53/?dl=1",
    "ca_deit_small": "https://cloud.tsinghua.edu.cn/f/02d8767a0981445b9606/?dl=1",
    "ca_deit_base": "https://cloud.tsinghua.edu.cn/f/0dee573498554f11a6c7/?dl=1",
}
default_cfgs = generate_default_cfgs(
    {
        name: family_cfg("patch_embed.proj", url=(url, f"{name}_release.pth"), custom_load=True)
        for name, url in RELEASE_URLS.items()
    }
)


def _create(variant: str, pretrained: bool, **kwargs: Any) -> CirculantVisionTransformer:
    # timm hands an overlaid source (file=, url=) to its own weights-only reader unless custom_load is
    # set; the release format needs cat's safe loader, which reads plain state dicts as well.
    if kwargs.get("pretrained_cfg_overlay"):
        kwargs["pretrained_cfg_overlay"] = {"custom_load": True, **kwargs["pretrained_cfg_overlay"]}
    try:
        return build_family_model(CirculantVisionTransformer, variant, pretrained, default_out_indices=3, **kwargs)
    except urllib.error.URLError as error:  # timm's download, before cat's loader sees a file
        raise CheckpointError(
            f"{variant}: pretrained=True could not download its weights ({error.reason}); the authors' release is "
            f"{RELEASE_URLS[variant]}. Offline, pass a local copy: --checkpoint /path/to/the.pth on the command line, "
            "pretrained_cfg_overlay=dict(file='/path/to/the.pth') in Python"
        ) from error


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
    model = timm.create_model(
        "deit_small_patch16_224", pretrained=pretrained, attn_layer=TokenReweightedAttention, **kwargs
    )
    return cast(VisionTransformer, model)
