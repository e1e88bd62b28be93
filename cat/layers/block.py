"""The circulant-attention transformer block shared by every CA model."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from timm.layers import DropPath, Mlp, register_notrace_function, register_notrace_module, trunc_normal_
from torch import Tensor, nn

from cat.ops import CirculantAttention
from cat.ops.circulant import Reweight
from cat.ops.dft import constant

LayerNorm6 = partial(nn.LayerNorm, eps=1e-6)

# The FFT attention checks shapes and picks its path from them: FX (torchvision's and timm's feature
# extraction) keeps it as one leaf call, differentiable like any module.
register_notrace_module(CirculantAttention)


def centre_tap(shape: tuple[int, ...], device: torch.device | None = None) -> Tensor:
    """A float64 depthwise kernel (C, 1, 3, 3) on ``device`` that passes its input through: 1 at the centre, 0
    elsewhere."""
    kernel = torch.zeros(shape, dtype=torch.float64, device=device)
    kernel[..., 1, 1] = 1.0
    return kernel


# TorchScript (timm's scripting of a model) calls this as Python: the cached constant is not scriptable. It reads an
# ignored function's arguments and result as tensors when they carry no annotation. FX keeps it one leaf call (FX
# wraps only public names).
@register_notrace_function
@torch.jit.ignore
def with_centre_tap(weight):
    """A depthwise kernel ``weight`` (C, 1, 3, 3) with 1 added at its centre (:func:`centre_tap`)."""
    return weight + constant(centre_tap, (tuple(weight.shape),), weight.dtype, weight.device)


def init_vit_weights(m: nn.Module) -> None:
    """ViT initialisation: truncated-normal (std 0.02) linear weights, zero biases, unit LayerNorms."""
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


class CirculantBlock(nn.Module):
    """x += DWConv3x3(x); x += DropPath(CirAttn(LN(x))); x += DropPath(MLP(LN(x))).

    Tokens are (B, N, C) on an H x W grid given as ``hw``. Parameter names match the released
    CA-DeiT (``cpe``, ``norm1``, ``attn``, ``norm2``, ``mlp.fc1``, ``mlp.fc2``).
    """

    def __init__(
        self,
        dim: int,
        mlp_ratio: float = 4.0,
        head_dim: int = 1,
        reweight: Reweight = "post",
        proj_drop: float = 0.0,
        drop_path: float = 0.0,
        norm_layer: Callable[[int], nn.Module] = LayerNorm6,
        act_layer: type[nn.Module] = nn.GELU,
    ) -> None:
        super().__init__()
        # Channels-last like the token view it convolves, so its weight's gradient has the weight's strides:
        # DDP compares them in full and otherwise warns "Grad strides do not match bucket view strides".
        self.cpe = nn.Conv2d(dim, dim, 3, padding=1, groups=dim).to(memory_format=torch.channels_last)
        self.norm1 = norm_layer(dim)
        self.attn = CirculantAttention(dim, head_dim=head_dim, reweight=reweight, proj_drop=proj_drop)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.num_prefix_tokens = 0  # leading tokens not on the grid, left as they are
        # Set by reparameterize: the convolution with its centre tap, x + cpe(x) as it is.
        self.cpe_with_identity: nn.Conv2d | None = None
        self.apply(init_vit_weights)

    def reparameterize(self) -> None:
        """For inference (``timm.utils.reparameterize_model``): the positional convolution's kernel with its centre
        tap added once (``cpe_with_identity``, in place of ``cpe``) and the attention's projections joined
        (:meth:`CirculantAttention.reparameterize`): two operators fewer a block, the same outputs. One way; the
        state dict's names change with it."""
        self.attn.reparameterize()
        if self.cpe_with_identity is not None:
            return
        weight = self.cpe.weight
        C = weight.shape[0]
        conv = nn.Conv2d(C, C, 3, padding=1, groups=C, device=weight.device, dtype=weight.dtype)
        conv.load_state_dict({"weight": with_centre_tap(weight), "bias": self.cpe.bias})
        self.cpe_with_identity = conv.to(memory_format=torch.channels_last).requires_grad_(weight.requires_grad)
        del self.cpe

    def forward(self, x: Tensor, hw: tuple[int, int]) -> Tensor:
        P = self.num_prefix_tokens
        if P > 0:  # tokens off the grid (PVT's class token) pass by
            return torch.cat([x[:, :P], self.forward_tokens(x[:, P:], hw)], dim=1)
        return self.forward_tokens(x, hw)

    def forward_tokens(self, x: Tensor, hw: tuple[int, int]) -> Tensor:
        B, N, C = x.shape
        # A channels-last view in and out: the depthwise conv then needs no layout copies (2x here).
        maps = x.reshape(B, hw[0], hw[1], C).permute(0, 3, 1, 2)
        # x + cpe(x) is one convolution whose kernel has 1 added at its centre: the block adds a 3x3 kernel instead of
        # a (B, N, C) map, and the backward gives x one gradient instead of two that autograd then adds. (A cached
        # constant, not a buffer: DDP would broadcast a buffer at every step.)
        if self.cpe_with_identity is not None:
            kernel, bias = self.cpe_with_identity.weight, self.cpe_with_identity.bias
        else:
            kernel, bias = with_centre_tap(self.cpe.weight), self.cpe.bias
        x = F.conv2d(maps, kernel, bias, padding=1, groups=C).permute(0, 2, 3, 1).reshape(B, N, C)
        x = x + self.drop_path1(self.attn(self.norm1(x), hw))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class CirculantBlockNHWC(CirculantBlock):
    """:class:`CirculantBlock` on (B, H, W, C) maps, for stages built from NHWC blocks (Swin)."""

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        B, H, W, C = x.shape
        return self.forward_tokens(x.reshape(B, H * W, C), (H, W)).reshape(B, H, W, C)
