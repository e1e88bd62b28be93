"""Circulant attention with the token gate and output projection as one autograd function whose
backward is written in the frequency domain, so training stores less than softmax attention.

Saved for the backward: the normalised input x (which the gate's linear layer saves anyway, so it
is shared) and the gate's pre-activation z: N*C floats of its own. Everything else (the spectra,
the softmax weights, the pre-gate output, the projection's input) is recomputed from x in the
backward, one group of channels at a time. Autograd through the plain ops stores every
intermediate spectrum instead (docs/perf.md has the accounting).

The gradients are again correlations, taken with FFTs. For one head with weights w and logits l,
out_c[i] = sum_d w[d] v_c[i+d] and l[d] = scale * sum_{c,i} q_c[i] k_c[i+d], so with G = rfft2(g_out):
    F(g_v_c) = F(w) G_c,       F(g_w) = sum_c conj(G_c) F(v_c),
    g_l = scale * w * (g_w - <g_w, w>)              (softmax),
    F(g_q_c) = conj(F(g_l)) F(k_c),   F(g_k_c) = F(g_l) F(q_c).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from .spectral import (
    attend_spectra,
    autocast_state,
    circulant_weights,
    fft_dtype,
    head_sum,
    no_autocast,
    pack_spectrum,
    parseval_weights,
    per_head,
    unpack_spectrum,
)

__all__ = ["lean_circulant_attention"]


# Floats per channel group of the loops below (B * N * channels): one group's transients (about
# seven times its share of the block's B*N*C floats) are freed before the next group starts, so a
# training step's peak holds one group's, and the allocator reuses the same blocks group after
# group. Smaller groups cost more small ops; 2**18 keeps a 224^2 batch of 8 in about two groups.
GROUP_FLOATS = 2**18


def channel_groups(channels: int, head_dim: int, tokens: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of whole heads splitting ``channels`` into groups of about GROUP_FLOATS
    floats for ``tokens`` (B * N) tokens."""
    heads = channels // head_dim
    groups = min(heads, max(1, -(-tokens * channels // GROUP_FLOATS)))
    size = -(-heads // groups) * head_dim
    return [(lo, min(lo + size, channels)) for lo in range(0, channels, size)]


def spectrum_rows(spectrum: Tensor, hw: tuple[int, int], packed: bool) -> Tensor:
    """A half spectrum (B, c, H, W//2+1) of real H x W maps as real rows (B, c, R): its (re, im)
    pairs, R = 2*H*(W//2+1), a view; or with ``packed`` its N independent reals (:func:`pack_spectrum`)."""
    B, c = spectrum.shape[:2]
    if packed:
        return pack_spectrum(spectrum, hw[1]).view(B, c, -1)
    return torch.view_as_real(spectrum).view(B, c, -1)


def rows_spectrum(rows: Tensor, hw: tuple[int, int], packed: bool) -> Tensor:
    """The half spectrum (B, c, H, W//2+1) complex that :func:`spectrum_rows` made ``rows`` from."""
    B, c = rows.shape[:2]
    if packed:
        return unpack_spectrum(rows.view(B, c, *hw), hw[1])
    return torch.view_as_complex(rows.view(B, c, hw[0], hw[1] // 2 + 1, 2))


def input_spectrum(x: Tensor, hw: tuple[int, int], packed: bool) -> Tensor:
    """The rfft2 spectrum of tokens x (B, N, C) as real rows (B, C, R) (:func:`spectrum_rows`)."""
    B, N, C = x.shape
    with no_autocast(x.device):
        return spectrum_rows(torch.fft.rfft2(x.transpose(1, 2).reshape(B, C, *hw).to(fft_dtype(x.dtype))), hw, packed)


def group_rows(qkv: Tensor, lo: int, hi: int) -> Tensor:
    """The rows of the (3C, C) qkv weight that make channels [lo, hi) of q, k and v."""
    C = qkv.shape[0] // 3
    if (lo, hi) == (0, C):
        return qkv
    return torch.cat([qkv[lo:hi], qkv[C + lo : C + hi], qkv[2 * C + lo : 2 * C + hi]])


def set_group_rows(qkv: Tensor, lo: int, hi: int, group: Tensor) -> None:
    """Write ``group`` (what :func:`group_rows` took for channels [lo, hi)) back into the rows of ``qkv``."""
    C, c = qkv.shape[0] // 3, hi - lo
    for i in range(3):
        qkv[i * C + lo : i * C + hi] = group[i * c : (i + 1) * c]


def value_bias(qkv_bias: Tensor, lo: int, hi: int) -> Tensor:
    """v's entries of a (3C,) qkv bias (or of its gradient) for channels [lo, hi), a view: the only part of the bias
    that acts in circulant attention (:func:`cat.ops.circulant.circulant_attention_layer` says why)."""
    C = qkv_bias.shape[0] // 3
    return qkv_bias[2 * C + lo : 2 * C + hi]


def group_spectra(spectrum: Tensor, rows: Tensor, hw: tuple[int, int], packed: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The rfft2 spectra (B, c, H, W//2+1) of q, k, v from the input spectrum's real rows
    (:func:`input_spectrum`) and qkv ``rows``. The FFT is linear, so the weight is applied to the
    spectrum of x: one FFT instead of three."""
    qkv = torch.matmul(rows, spectrum).to(spectrum.dtype)  # autocast may run the GEMM in bf16/fp16
    with no_autocast(spectrum.device):
        q, k, v = rows_spectrum(qkv, hw, packed).chunk(3, dim=1)
    return q, k, v


def silu_slope(z: Tensor, sig: Tensor) -> Tensor:
    """d SiLU(z) / dz from z and sigmoid(z)."""
    return sig * (1 + z * (1 - sig))


def _autocast_as(device: torch.device, state: tuple[bool, torch.dtype | None]) -> contextlib.AbstractContextManager:
    enabled, dtype = state
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=enabled)


def _forward(
    x, qkv_weight, gate_pre, proj_weight, proj_bias, hw, head_dim, scale, keep_weights, packed, qkv_bias, prefix
):
    """The forward of :func:`lean_circulant_attention`, without autograd."""
    B, T, C = x.shape
    P = prefix.shape[1] if prefix is not None else 0
    N = T - P
    spectrum = input_spectrum(x[:, P:], hw, packed)
    y = spectrum.new_empty(B, C, *hw)
    weights = spectrum.new_empty(B, C // head_dim, *hw) if keep_weights else spectrum.new_empty(0)
    for lo, hi in channel_groups(C, head_dim, B * N):
        q_f, k_f, v_f = group_spectra(spectrum, group_rows(qkv_weight, lo, hi), hw, packed)
        with no_autocast(x.device):
            _, w = attend_spectra(q_f, k_f, v_f, hw, head_dim, scale, return_weights=True, out=y[:, lo:hi])
        if keep_weights:
            weights[:, lo // head_dim : hi // head_dim] = w
        del q_f, k_f, v_f, w
    del spectrum
    y = y.view(B, C, N)
    if qkv_bias is not None:  # only v's part acts (circulant_attention_layer): a constant through the weights
        y += value_bias(qkv_bias, 0, C)[:, None].to(y.dtype)
    y = y.transpose(1, 2)
    if gate_pre is None:
        u = torch.cat([prefix.to(y.dtype), y], dim=1) if P else y
    else:  # the gate multiplied into its own fresh buffer: one token-major transient, not two
        u = F.silu(gate_pre)
        u[:, P:].mul_(y)
        if P:
            u[:, :P].mul_(prefix)
    return F.linear(u, proj_weight, proj_bias), weights


class _LeanCirculantAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *args) -> tuple[Tensor, Tensor]:  # the arguments of _forward
        out, weights = _forward(*args)
        x, qkv_weight, gate_pre, proj_weight, proj_bias, hw, head_dim, scale, _, packed, qkv_bias, prefix = args
        ctx.save_for_backward(x, qkv_weight, gate_pre, proj_weight, qkv_bias, prefix)
        ctx.hw, ctx.head_dim, ctx.scale, ctx.packed = hw, head_dim, scale, packed
        ctx.has_bias = proj_bias is not None
        ctx.autocast = autocast_state(x.device)
        ctx.mark_non_differentiable(weights)
        return out, weights

    @staticmethod
    def backward(ctx, g_out: Tensor, _g_weights: Tensor | None):
        x, qkv_weight, gate_pre, proj_weight, qkv_bias, prefix = ctx.saved_tensors
        hw, head_dim, scale = ctx.hw, ctx.head_dim, ctx.scale
        B, T, C = x.shape
        P = prefix.shape[1] if prefix is not None else 0
        N = T - P
        work = fft_dtype(x.dtype)
        device = x.device
        with _autocast_as(device, ctx.autocast):
            spectrum = input_spectrum(x[:, P:], hw, ctx.packed)
            g_u = torch.matmul(g_out, proj_weight)  # the gradient of the projection's input
            g_out_cf = g_out[:, P:].transpose(1, 2)
            # Gradients of the qkv weight and of x from the gradient spectra (Parseval), so the
            # three gradient maps of each group need no inverse FFT: one for all of g_x at the end.
            weighted = spectrum * parseval_weights(hw, ctx.packed, work, device)
            g_x_rows = torch.zeros_like(spectrum)
            g_qkv_weight = torch.empty_like(qkv_weight, dtype=work)
            g_proj_weight = torch.empty_like(proj_weight, dtype=work)
            g_gate_pre = torch.empty_like(gate_pre) if gate_pre is not None else None
            g_qkv_bias = torch.zeros_like(qkv_bias, dtype=work) if qkv_bias is not None else None  # q's, k's: 0
            for lo, hi in channel_groups(C, head_dim, B * N):
                c = hi - lo
                rows = group_rows(qkv_weight, lo, hi)
                # Recompute what the forward did not keep: the spectra, weights and pre-gate output.
                q_f, k_f, v_f = group_spectra(spectrum, rows, hw, ctx.packed)
                with no_autocast(device):
                    w = circulant_weights(q_f, k_f, hw, head_dim, scale)
                    w_f = torch.fft.rfft2(w)
                    y = torch.fft.irfft2(per_head(torch.conj(w_f), v_f, head_dim), s=hw).view(B, c, N)
                    if qkv_bias is not None:
                        y += value_bias(qkv_bias, lo, hi)[:, None].to(work)
                # Through the projection and the gate (channels first: (B, c, N)).
                g_u_g = g_u[:, P:, lo:hi].transpose(1, 2)
                if gate_pre is not None and g_gate_pre is not None:
                    z = gate_pre[:, P:, lo:hi].transpose(1, 2).to(work)
                    sig = torch.sigmoid(z)
                    gate = z * sig
                    g_gate_pre[:, P:, lo:hi] = (g_u_g * y * silu_slope(z, sig)).transpose(1, 2)
                    g_y, u = g_u_g * gate, y * gate
                    del z, sig, gate
                else:
                    g_y, u = g_u_g, y
                g_proj_weight[:, lo:hi] = torch.matmul(g_out_cf, u.transpose(1, 2)).sum(0)
                del y, u, g_u_g
                # Through the circulant attention, in the frequency domain.
                with no_autocast(device):
                    g_f = torch.fft.rfft2(g_y.reshape(B, c, *hw).to(work))
                    del g_y
                    if g_qkv_bias is not None:  # v's bias: g_y summed over the tokens, its spectrum at frequency 0
                        value_bias(g_qkv_bias, lo, hi).copy_(g_f[:, :, 0, 0].real.sum(0))
                    g_w = torch.fft.irfft2(head_sum(torch.conj(g_f) * v_f, head_dim), s=hw)
                    g_logits = scale * w * (g_w - (g_w * w).sum((-2, -1), keepdim=True))
                    del g_w
                    l_f = torch.fft.rfft2(g_logits)
                    del g_logits
                    g_qkv_f = torch.empty(B, 3 * c, *l_f.shape[-2:], dtype=l_f.dtype, device=device)
                    g_qkv_f[:, :c] = per_head(torch.conj(l_f), k_f, head_dim)
                    g_qkv_f[:, c : 2 * c] = per_head(l_f, q_f, head_dim)
                    g_qkv_f[:, 2 * c :] = per_head(w_f, g_f, head_dim)
                    del q_f, k_f, v_f, g_f, l_f, w_f
                    g_qkv = spectrum_rows(g_qkv_f, hw, ctx.packed)
                # Through the qkv projection, on the spectrum's rows.
                set_group_rows(g_qkv_weight, lo, hi, torch.matmul(g_qkv, weighted.transpose(1, 2)).sum(0))
                g_x_rows += torch.matmul(rows.t(), g_qkv)
                del g_qkv, g_qkv_f
            del spectrum, weighted
            g_prefix = None
            if P:  # the prefix rows: through the projection and the gate only
                u = prefix.to(work)
                g_prefix = g_u[:, :P].to(work)
                if gate_pre is not None and g_gate_pre is not None:
                    z = gate_pre[:, :P].to(work)
                    sig = torch.sigmoid(z)
                    g_gate_pre[:, :P] = g_prefix * u * silu_slope(z, sig)
                    g_prefix, u = g_prefix * z * sig, u * z * sig
                g_proj_weight += torch.matmul(g_out[:, :P].transpose(1, 2).to(work), u).sum(0)
                g_prefix = g_prefix.to(prefix.dtype)
            # x's gradient channels first, returned transposed (a view; autograd adds it as it is). Its prefix
            # rows reach the output only through the caller's own ops: zeros, the grid's written beside them.
            g_x = torch.empty(B, C, T, dtype=work, device=device)
            g_x[:, :, :P] = 0
            with no_autocast(device):
                torch.fft.irfft2(rows_spectrum(g_x_rows, hw, ctx.packed), s=hw, out=g_x[:, :, P:].view(B, C, *hw))
            g_x = g_x.transpose(1, 2).to(x.dtype)
            g_proj_bias = g_out.sum((0, 1)) if ctx.has_bias else None
        return (
            g_x,
            g_qkv_weight.to(qkv_weight.dtype),
            g_gate_pre,
            g_proj_weight.to(proj_weight.dtype),
            g_proj_bias.to(proj_weight.dtype) if g_proj_bias is not None else None,
            None,
            None,
            None,
            None,
            None,
            g_qkv_bias.to(qkv_bias.dtype) if g_qkv_bias is not None else None,
            g_prefix,
        )


def lean_circulant_attention(
    x: Tensor,
    qkv_weight: Tensor,
    gate_pre: Tensor | None,
    proj_weight: Tensor,
    proj_bias: Tensor | None,
    hw: tuple[int, int],
    head_dim: int,
    scale: float,
    keep_weights: bool = False,
    packed: bool = False,
    qkv_bias: Tensor | None = None,
    prefix: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """proj(CirAttn(x W_q, x W_k, x W_v) * SiLU(gate_pre)) for tokens x (B, N, C) on an ``hw`` grid,
    and, with ``keep_weights``, the attention weights (B, heads, H, W), not differentiable (else an
    empty tensor). ``gate_pre`` None: no gate. ``qkv_bias`` (3C,): q, k, v with a bias (timm's
    ``qkv_bias=True`` models, converted by :func:`cat.convert`), of which only v's part acts
    (:func:`cat.ops.circulant.circulant_attention_layer` says why); q's and k's get zero gradient.
    ``prefix`` (B, P, C): the attention outputs of P tokens that precede the grid (a converted ViT's class
    and register tokens, whose softmax attention the caller computes); x and ``gate_pre`` then hold those
    tokens first, (B, P + N, C), and the output covers all of them, gated and projected alike. ``packed``:
    the qkv GEMM runs on the packed spectrum's N rows instead of the half spectrum's 2*H*(W//2+1), at the
    price of unpacking its output (docs/perf.md compares the two). Checks of shapes and arguments are the caller's
    (:class:`cat.ops.CirculantAttention`)."""
    args = (
        x,
        qkv_weight,
        gate_pre,
        proj_weight,
        proj_bias,
        hw,
        head_dim,
        scale,
        keep_weights,
        packed,
        qkv_bias,
        prefix,
    )
    # A trace (torch.jit.trace) cannot record the autograd.Function: it records the forward's plain ops instead.
    tensors = (x, qkv_weight, gate_pre, proj_weight, proj_bias, qkv_bias, prefix)
    needs_grad = any(t is not None and t.requires_grad for t in tensors)
    if torch.is_grad_enabled() and needs_grad and not torch.jit.is_tracing():
        return _lean_training(*args)
    return _forward(*args)  # inference: no autograd.Function overhead


# Traced, AOTAutograd's common-subexpression pass merges the backward's recomputation with the forward, which then
# saves its intermediates after all (CA-DeiT-T at 224^2, B=32: 1244 MiB saved, 819 eagerly, 1355 through autograd);
# so torch.compile calls it as it is, and compiles the model's other ops around it.
@torch.compiler.disable(reason="the lean function recomputes in its backward what a traced forward would save")
def _lean_training(*args) -> tuple[Tensor, Tensor]:
    return _LeanCirculantAttention.apply(*args)
