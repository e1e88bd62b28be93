"""Circulant attention: self-attention whose attention map is exactly BCCB.

For an H x W token grid with N = H*W tokens, a BCCB (block-circulant with circulant blocks)
attention matrix has entries that depend only on the 2-D offset between query and key on the
torus. Such a matrix is a circular convolution, so attention reduces to 2-D FFTs and costs
O(N log N) instead of O(N^2).

Conventions: the public function takes (B, H, W, C) tokens; inside, maps are channels first,
(B, C, H, W), and spectra are the unnormalised ``rfft2`` over the last two dims, (B, C, H, W//2+1),
either complex or as real (re, im) pairs (B, C, H, W//2+1, 2) for the matmul backend. Transforms
always run in float32 (float64 for float64 inputs) with autocast disabled: cuFFT rejects half
precision for non-power-of-two grids, and the softmax logits need the range.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dft import irfft2_matmul, rfft2_matmul
from .fused import lean_circulant_attention, value_bias
from .spectral import attend_spectra, fft_dtype, head_sum, no_autocast

Reweight = Literal["post", "pre", "none"]
FFTBackend = Literal["fft", "matmul"]
LeanPolicy = bool | Literal["auto"]

# lean="auto": a block trains through the lean function when its input holds at least this many floats
# (B*N*C), through autograd below it. Autograd is the faster of the two wherever it was measured (CPU:
# docs/perf.md), and the lean function's saving grows with B*N*C: from here on (a 1024^2 image of CA-DeiT-T,
# 786k; a 224^2 batch of 8 holds 301k, a 512^2 batch of 2 393k) it keeps the memory lean puts it at.
LEAN_AUTO_MIN_FLOATS = 2**19


def check_lean(lean: object) -> LeanPolicy:
    """``lean`` if it is a lean policy: True (always the lean function), False (always autograd) or 'auto'."""
    if lean is True or lean is False or lean == "auto":
        return lean
    raise ValueError(f"lean must be True, False or 'auto'; got {lean!r}")


def uses_lean(lean: bool | str, floats: int) -> bool:
    """Whether a block whose input holds ``floats`` (B*N*C) trains through the lean function."""
    return lean is True or (lean == "auto" and floats >= LEAN_AUTO_MIN_FLOATS)


def _attend_pairs(
    q: Tensor, k: Tensor, v: Tensor, hw: tuple[int, int], head_dim: int, scale: float
) -> tuple[Tensor, Tensor]:
    """:func:`attend_spectra` in real arithmetic on (B, C, H, W//2+1, 2) (re, im) spectra, with
    matrix-product DFTs: no complex dtype anywhere, so it exports to ONNX."""
    B, C, Hf, Wf, _ = q.shape
    heads = C // head_dim
    (qr, qi), (kr, ki), (vr, vi) = q.unbind(-1), k.unbind(-1), v.unbind(-1)
    prod = head_sum(torch.stack((qr * kr + qi * ki, qr * ki - qi * kr), dim=-1), head_dim)  # conj(q) * k
    logits = irfft2_matmul(prod.flatten(-3), hw)
    weights = (logits.reshape(B, heads, -1) * scale).softmax(dim=-1).view(B, heads, *hw)
    ar, ai = rfft2_matmul(weights).view(B, heads, 1, Hf, Wf, 2).unbind(-1)
    vr, vi = (t.reshape(B, heads, head_dim, Hf, Wf) for t in (vr, vi))
    out = torch.stack((ar * vr + ai * vi, ar * vi - ai * vr), dim=-1)  # conj(A) * v
    return irfft2_matmul(out.reshape(B, C, Hf * Wf * 2), hw), weights


def check_fft_backend(backend: str) -> FFTBackend:
    """``backend`` if it is one cat has. There is no automatic choice ('auto' is gone: it picked
    'fft' everywhere, docs/perf.md); 'fft' is the default and 'matmul' is chosen for what it
    enables (ONNX without DFT ops, low-precision matrix units)."""
    if backend == "fft" or backend == "matmul":
        return backend  # type: ignore[return-value]
    raise ValueError(f"fft_backend must be 'fft' or 'matmul'; got {backend!r}")


def spectrum(x: Tensor, backend: str) -> Tensor:
    """Unnormalised rfft2 of real (B, C, H, W) as a real (B, C, H, W//2+1, 2) tensor of (re, im)."""
    if backend == "matmul":
        B, C, H, W = x.shape
        return rfft2_matmul(x).view(B, C, H, W // 2 + 1, 2)
    return torch.view_as_real(torch.fft.rfft2(x))


def attend(
    q: Tensor, k: Tensor, v: Tensor, hw: tuple[int, int], head_dim: int, scale: float, backend: str
) -> tuple[Tensor, Tensor]:
    """Output (B, C, H, W) and weights (B, heads, H, W) from (re, im) spectra made by :func:`spectrum`."""
    if backend == "matmul":
        return _attend_pairs(q, k, v, hw, head_dim, scale)
    q_f, k_f, v_f = (torch.view_as_complex(t) for t in (q, k, v))
    return cast(tuple[Tensor, Tensor], attend_spectra(q_f, k_f, v_f, hw, head_dim, scale, return_weights=True))


def _evaluated_annotations(fn: Callable) -> Callable:
    """``fn`` with its annotations evaluated: TorchScript reads those of an ignored function as they
    are, and this module's are strings (``from __future__ import annotations``)."""
    fn.__annotations__ = typing.get_type_hints(fn)
    return fn


def _check_head_dim(channels: int, head_dim: int) -> None:
    if head_dim < 1 or channels % head_dim:
        raise ValueError(f"head_dim={head_dim} must be a positive divisor of the channel count {channels}")


def circulant_attention(
    q: Tensor, k: Tensor, v: Tensor, head_dim: int = 1, scale: float | None = None, fft_backend: FFTBackend = "fft"
) -> Tensor:
    """Circulant (BCCB) attention over a 2-D token grid, in O(N log N).

    Args:
        q, k, v: real tensors shaped (B, H, W, C), the tokens laid out on their H x W grid.
        head_dim: channels per head; C must be divisible by it. ``1`` (per-channel attention) is
            what the released CA-DeiT uses.
        scale: multiplies the logits. ``None`` means ``1 / sqrt(N * head_dim)`` with N = H*W, the
            scale the released CA-DeiT computes; the paper writes ``1 / (N * sqrt(d))``, which can
            be passed explicitly. Any float is accepted.
        fft_backend: ``'fft'`` (torch.fft) or ``'matmul'`` (dense DFT matrices: no complex dtypes,
            ONNX-exportable).

    For each batch item and head, with offsets d on the H x W torus (``+`` modulo (H, W)):
        logits[d] = scale * sum_i <q_i, k_{i+d}>      (QK^T projected onto the BCCB subspace, times N)
        w = softmax(logits) over the N offsets
        out_i = sum_d w[d] * v_{i+d}                  (per channel of the head)

    The FFTs run in float32 (float64 for float64 inputs) whatever autocast is active; the result
    has the promoted dtype of the inputs.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"circulant_attention expects {name} shaped (B, H, W, C); got shape {tuple(t.shape)}")
        if t.is_complex():
            raise ValueError(f"circulant_attention expects real tensors; {name} is {t.dtype}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have the same shape; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, W, C = q.shape
    _check_head_dim(C, head_dim)
    if scale is None:
        scale = 1.0 / math.sqrt(H * W * head_dim)
    out_dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    work = fft_dtype(out_dtype)
    backend = check_fft_backend(fft_backend)
    with no_autocast(q.device):
        q_f, k_f, v_f = (spectrum(t.to(work).permute(0, 3, 1, 2), backend) for t in (q, k, v))
        out, _ = attend(q_f, k_f, v_f, (H, W), head_dim, scale, backend)
    return out.permute(0, 2, 3, 1).to(out_dtype)


class CirculantAttention(nn.Module):
    """Circulant attention with the SiLU token gate, as in the released CA-DeiT.

    Called as ``attn(x, hw)`` with x (B, N, C) and hw = (H, W), H*W = N. Parameter names follow the
    released checkpoints: ``qkv.weight`` (bias-free, 3C x C), ``gate.0.{weight,bias}``,
    ``proj.{weight,bias}``.

    The qkv weight is applied to the real and imaginary parts of ``rfft2(x)``: the FFT is linear,
    so this equals projecting before the FFT while taking one FFT instead of three
    (``pack_spectrum=True``: to the spectrum's N independent reals; docs/perf.md compares them).
    With ``lean=True``, the FFT backend and post- or no reweighting, gate, attention and
    projection run as one autograd function (:mod:`cat.ops.fused`) that keeps only x and the
    gate's pre-activation for the backward and recomputes the rest: it trades a recomputation in
    the backward for the activations autograd would store (``lean=False`` keeps them). ``'auto'``
    (default) takes the lean function only for inputs of at least :data:`LEAN_AUTO_MIN_FLOATS`
    floats (B*N*C), where the memory it saves is large; :func:`set_lean_attention` sets a whole
    model (docs/perf.md has the measured costs).
    With ``keep_weights = True`` each forward stores its attention weights (the equivalent global
    convolution kernel per head) in ``last_weights``, shaped (B, heads, H, W).

    ``reweight`` selects the token reweighting of the paper's Table 5: ``'post'`` (default,
    out = CirAttn(Q, K, V) * T), ``'pre'`` (out = CirAttn(Q, K, V * T)) or ``'none'``, where
    T = SiLU(Linear(x)).
    """

    def __init__(
        self,
        dim: int,
        head_dim: int = 1,
        reweight: Reweight = "post",
        proj_drop: float = 0.0,
        scale: float | None = None,
        fft_backend: FFTBackend = "fft",
        pack_spectrum: bool = False,
        lean: LeanPolicy = "auto",
    ) -> None:
        super().__init__()
        _check_head_dim(dim, head_dim)
        if reweight not in ("post", "pre", "none"):
            raise ValueError(f"reweight must be 'post', 'pre' or 'none'; got {reweight!r}")
        self.dim = dim
        self.head_dim = head_dim
        self.reweight = reweight
        self.scale = scale
        check_fft_backend(fft_backend)  # validate early
        self.fft_backend = fft_backend
        self.pack_spectrum = pack_spectrum
        self.lean = check_lean(lean)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.gate = nn.Sequential(nn.Linear(dim, dim), nn.SiLU()) if reweight != "none" else None
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        # Analysis tools set keep_weights to read each forward's attention weights (B, heads, H, W).
        self.keep_weights = False
        self.last_weights: Tensor | None = None

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, head_dim={self.head_dim}, reweight={self.reweight!r}, "
            f"fft_backend={self.fft_backend!r}, lean={self.lean}"
        )

    def forward(self, x: Tensor, hw: tuple[int, int]) -> Tensor:
        gate_weight: Tensor | None = None
        gate_bias: Tensor | None = None
        if self.gate is not None:
            # A Linear (no cast here: TorchScript compiles this method, and torch types a submodule's parameter loosely)
            gate_weight, gate_bias = self.gate[0].weight, self.gate[0].bias  # type: ignore[assignment]
        out, weights = circulant_attention_layer(
            x,
            hw,
            self.qkv.weight,
            gate_weight,
            gate_bias,
            self.proj.weight,
            self.proj.bias,
            self.head_dim,
            self.scale,
            self.reweight,
            self.fft_backend,
            self.lean,
            self.keep_weights,
            self.pack_spectrum,
            None,  # no qkv bias, no prefix tokens (TorchScript takes no defaults of an ignored function)
            None,
        )
        if self.keep_weights and not torch.jit.is_scripting():
            self.last_weights = weights.detach()
        return self.proj_drop(out)


# TorchScript calls this as Python: the FFT attention (an autograd.Function, complex spectra,
# autocast scopes) is not scriptable, so a scripted model runs but cannot be saved; torch.export
# gives a serialised program.
@torch.jit.ignore
@_evaluated_annotations
def circulant_attention_layer(
    x: Tensor,
    hw: tuple[int, int],
    qkv_weight: Tensor,
    gate_weight: Tensor | None,
    gate_bias: Tensor | None,
    proj_weight: Tensor,
    proj_bias: Tensor,
    head_dim: int,
    scale: float | None,
    reweight: str,
    fft_backend: str,  # FFTBackend and LeanPolicy: TorchScript, which compiles this, reads no Literal
    lean: bool | str,
    keep_weights: bool,
    pack_spectrum: bool,
    qkv_bias: Tensor | None = None,
    prefix: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """:class:`CirculantAttention`'s computation on its weights: the output (B, N, C) before the
    dropout, and the attention weights (B, heads, H, W) (an empty tensor unless ``keep_weights`` or
    computed anyway). For :func:`cat.convert`'s attention also: ``qkv_bias`` (3C,), and ``prefix`` (B, P, C),
    the attention outputs of P tokens before the grid (class and register tokens), which x then holds first,
    (B, P + N, C); they are gated and projected with the grid's (post- or no reweighting).

    Of the qkv bias only v's part acts: a constant added to q or k shifts all of a head's logits alike (each
    logit sums over the whole torus), which the softmax ignores, and v's passes through weights that sum to 1
    as itself, a constant added to the output. So q's and k's get zero gradient, exactly."""
    C = qkv_weight.shape[1]
    if x.dim() != 3 or x.shape[-1] != C:
        raise ValueError(f"CirculantAttention(dim={C}) expects x shaped (B, N, {C}); got {tuple(x.shape)}")
    P = 0 if prefix is None else prefix.shape[1]
    if P and reweight == "pre":
        raise ValueError("tokens before the grid (prefix) need post- or no reweighting")
    B, T, C = x.shape
    N = T - P
    H, W = hw
    if H * W != N:
        raise ValueError(f"hw={tuple(hw)} gives {H * W} tokens but x has N={N}")
    backend = check_fft_backend(fft_backend)
    if backend == "fft" and torch.jit.is_tracing() and not keep_weights:
        gate = F.silu(F.linear(x, gate_weight, gate_bias)) if gate_weight is not None else None
        # From Python numbers: the tracer's sizes are tensors, whose power would round the scale to float32.
        traced_scale = (int(N) * head_dim) ** -0.5 if scale is None else float(scale)
        traced = _traced_layer(
            x, hw, qkv_weight, gate, proj_weight, proj_bias, qkv_bias, head_dim, traced_scale, reweight, prefix
        )
        return traced, x.new_empty(0)
    # A power, not math.sqrt: under torch.export N is symbolic and must stay so (any resolution).
    scale = (N * head_dim) ** -0.5 if scale is None else scale
    # Exported programs take the plain autograd ops: the lean function's channel groups depend on
    # B*N and would pin the exported batch and resolution; so would the size test of lean="auto",
    # hence the export check comes before it.
    if backend == "fft" and reweight != "pre" and not torch.compiler.is_exporting() and uses_lean(lean, B * N * C):
        gate_pre = F.linear(x, gate_weight, gate_bias) if gate_weight is not None else None
        return lean_circulant_attention(
            x,
            qkv_weight,
            gate_pre,
            proj_weight,
            proj_bias,
            hw,
            head_dim,
            scale,
            keep_weights,
            pack_spectrum,
            qkv_bias,
            prefix,
        )
    # Through autograd (pre-reweighting, the matmul backend, export, lean=False): training stores
    # every intermediate spectrum.
    gate = F.silu(F.linear(x, gate_weight, gate_bias)) if gate_weight is not None else None
    work = fft_dtype(x.dtype)
    with no_autocast(x.device):
        # Transposed before the grid is sliced: the slice's backward then fills rows, not a transposed copy
        # (0.90 -> 0.46 ms a block at 512^2, B=2, with a class token; docs/perf.md).
        x_f = spectrum(x.transpose(1, 2)[:, :, P:].reshape(B, C, H, W).to(work), backend)
    Wf = W // 2 + 1  # from the grid, not the spectrum: ONNX export cannot read a complex tensor's size
    flat = x_f.view(B, C, H * Wf * 2)
    if reweight == "pre":  # v, not the output, is gated
        qk = torch.matmul(qkv_weight[: 2 * C], flat).to(work)
        q_f, k_f = qk.view(B, 2 * C, H, Wf, 2).chunk(2, dim=1)
        assert gate is not None  # pre-reweighting has a gate (checked by the layer)
        v = F.linear(x, qkv_weight[2 * C :], value_bias(qkv_bias, 0, C) if qkv_bias is not None else None) * gate
        with no_autocast(x.device):
            v_f = spectrum(v.transpose(1, 2).reshape(B, C, H, W).to(work), backend)
    else:
        qkv = torch.matmul(qkv_weight, flat).to(work)  # autocast: maybe a bf16 GEMM
        q_f, k_f, v_f = qkv.view(B, 3 * C, H, Wf, 2).chunk(3, dim=1)
    with no_autocast(x.device):
        y, weights = attend(q_f, k_f, v_f, hw, head_dim, scale, backend)
    y = y.view(B, C, N)
    if qkv_bias is not None and reweight != "pre":  # v's bias, a constant through the weights ("pre": in v)
        y = y + value_bias(qkv_bias, 0, C)[:, None].to(y.dtype)
    y = y.transpose(1, 2)
    if prefix is not None and P:
        y = torch.cat([prefix.to(y.dtype), y], dim=1)
    if reweight == "post" and gate is not None:
        y = y * gate
    return F.linear(y, proj_weight, proj_bias), weights


# One operator of a torch.jit.trace graph: the trace-based FLOP counters (mmengine's get_model_complexity_info, which
# mmdet's and mmseg's get_flops.py run) see the attention whole and count it by the paper's formula (cat.mm registers
# the handle), as cat.flops does. The tracer cannot record the lean autograd.Function.
@torch.library.custom_op(
    "cat::circulant_attention",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, int head_dim, float scale) -> Tensor",
)
def traced_circulant_attention(q: Tensor, k: Tensor, v: Tensor, head_dim: int, scale: float) -> Tensor:
    """:func:`circulant_attention` (fft backend) as the operator ``cat::circulant_attention``."""
    return circulant_attention(q, k, v, head_dim, scale)


@traced_circulant_attention.register_fake
def _traced_circulant_attention_shape(q: Tensor, k: Tensor, v: Tensor, head_dim: int, scale: float) -> Tensor:
    return q.new_empty(q.shape, dtype=torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype))


def _traced_layer(
    x: Tensor,
    hw: tuple[int, int],
    qkv_weight: Tensor,
    gate: Tensor | None,
    proj_weight: Tensor,
    proj_bias: Tensor,
    qkv_bias: Tensor | None,
    head_dim: int,
    scale: float,
    reweight: str,
    prefix: Tensor | None,
) -> Tensor:
    """:func:`circulant_attention_layer`'s output as a trace records it: q, k and v projected in token space (the
    whole qkv bias applied: q's and k's parts do not act), then ``cat::circulant_attention``."""
    B, T, C = x.shape
    P = 0 if prefix is None else prefix.shape[1]
    q, k, v = F.linear(x[:, P:], qkv_weight, qkv_bias).view(B, *hw, 3 * C).chunk(3, dim=-1)
    if reweight == "pre" and gate is not None:  # no prefix here (refused above)
        v = v * gate.view(B, *hw, C)
    y = traced_circulant_attention(q, k, v, head_dim, scale).reshape(B, T - P, C)
    if prefix is not None and P:
        y = torch.cat([prefix.to(y.dtype), y], dim=1)
    if reweight == "post" and gate is not None:
        y = y * gate
    return F.linear(y, proj_weight, proj_bias)


def _torus_offset_index(hw: tuple[int, int], device: torch.device | None = None) -> Tensor:
    """(N, N) index of the 2-D offset (j - i) mod (H, W) between token i and token j."""
    H, W = hw
    ys, xs = torch.meshgrid(torch.arange(H, device=device), torch.arange(W, device=device), indexing="ij")
    ys, xs = ys.flatten(), xs.flatten()
    dy = (ys[None, :] - ys[:, None]) % H
    dx = (xs[None, :] - xs[:, None]) % W
    return dy * W + dx


def bccb_project(attn: Tensor, hw: tuple[int, int]) -> Tensor:
    """Orthogonal (Frobenius) projection of (..., N, N) matrices onto the BCCB matrices of an H x W grid.

    A BCCB matrix's entry (i, j) depends only on the torus offset j - i, so the nearest one averages
    the N entries sharing each offset (the wrapped 2-D diagonals). Works for non-square grids.
    """
    H, W = hw
    N = H * W
    if attn.dim() < 2 or attn.shape[-1] != N or attn.shape[-2] != N:
        raise ValueError(f"bccb_project expects (..., {N}, {N}) for hw={tuple(hw)}; got {tuple(attn.shape)}")
    offset = _torus_offset_index(hw, attn.device)
    flat = attn.reshape(*attn.shape[:-2], N * N)
    index = offset.flatten().expand_as(flat)
    diag_mean = torch.zeros(*attn.shape[:-2], N, dtype=attn.dtype, device=attn.device)
    diag_mean = diag_mean.scatter_add(-1, index, flat) / N
    return diag_mean[..., offset]


def circulant_attention_flops(num_tokens: int, channels: int, head_dim: int = 1) -> int:
    """Multiply-accumulates of circulant attention as the paper counts them.

    Per head of dim d over N tokens: N * log2(N) * (4d + 2) + 4 * N * d.
    """
    heads = channels // head_dim
    n = num_tokens
    return round(heads * (n * math.log2(n) * (4 * head_dim + 2) + 4 * n * head_dim))


def set_fft_backend(model: nn.Module, backend: FFTBackend) -> nn.Module:
    """Switch every :class:`CirculantAttention` in ``model`` (and ``cat.convert``'s attention) to ``backend``;
    returns ``model``."""
    check_fft_backend(backend)
    for module in model.modules():
        if isinstance(module, CirculantAttention) or hasattr(module, "fft_backend"):
            cast(Any, module).fft_backend = backend  # cat.convert's attention too
    return model


def set_lean_attention(model: nn.Module, lean: LeanPolicy) -> nn.Module:
    """Train every :class:`CirculantAttention` in ``model`` through the lean function (``True``:
    less memory), through autograd (``False``: faster steps, more memory), or each block by its size
    (``'auto'``: :data:`LEAN_AUTO_MIN_FLOATS`); returns ``model``."""
    lean = check_lean(lean)
    for module in model.modules():
        if isinstance(module, CirculantAttention) or hasattr(module, "lean"):
            cast(Any, module).lean = lean  # cat.convert's attention too
    return model
