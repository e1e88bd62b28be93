"""Circulant attention with its token gate and output projection as one autograd function whose backward is
written in the frequency domain: a fixed number of kernels per block, however large the batch.

What the backward starts from (``lean``):
  stored  the forward keeps the spectra of x and of q, k, v, the weights and the output (:func:`stored_floats`);
          the backward recomputes nothing. The faster of the two; ``auto`` takes it where the memory allows.
  lean    the forward keeps only x and the gate's pre-activation; the backward recomputes the rest, so training
          holds less than softmax attention would. It works through the channels in groups sized by a memory budget
          in bytes (:func:`channel_groups`): one group, and so a fixed kernel count, unless the budget is smaller
          than the block's working set.
Each group's stages run over all its channels at once (batched transforms and GEMMs).

The gradients are again correlations and convolutions. With the weights omega by backward offset
(:func:`cat.ops.spectral.circulant_weights`), Y = F(omega) V per channel, so with G = F(g_y) and Lambda = F(g_lambda):
    F(g_v) = conj(F omega) G,      F(g_omega) = conj(V) G,      g_lambda = scale * softmax'(g_omega),
    F(g_q) = Lambda K,             F(g_k) = conj(Lambda) Q,
and the gradients of the qkv weight and of x come from these spectra directly (Parseval), with one inverse
transform for all of x's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .dft import DFTBackend, irfft2, rfft2
from .precision import autocast_state, fft_itemsize
from .spectral import (
    attend_spectra,
    conj_mul,
    head_sum,
    pack_spectrum,
    parseval_weights,
    per_head,
    unpack_spectrum,
    weights_by_offset,
)

__all__ = ["circulant_attention_function", "channel_groups", "stored_floats"]

# Floats per channel and token that one group of the lean backward holds at its peak, beyond what the block keeps:
# the spectra of q, k, v and of their gradients (3.4 each for a 14x14 grid's 2*H*(W//2+1) = 224 reals per 196
# tokens), the weights, their spectrum and gradients, the output and its gradient.
LEAN_WORKING_FLOATS = 16


def stored_floats(tokens: int, channels: int, heads: int, hw: tuple[int, int]) -> int:
    """Floats the stored path keeps for the backward of a block of ``tokens`` (B*N) tokens: the spectra of x and of
    q, k, v (2*H*(W//2+1) reals per map of N), the weights and their spectrum, and the output."""
    H, W = hw
    spectrum = tokens * 2 * (W // 2 + 1) * H // (H * W)  # reals per map's spectrum, over the batch
    return (4 * channels + heads) * spectrum + heads * tokens + channels * tokens


def channel_groups(
    channels: int, head_dim: int, tokens: int, itemsize: int, budget_bytes: int
) -> list[tuple[int, int]]:
    """[lo, hi) ranges of whole heads in which the lean function works through ``channels`` for ``tokens`` (B*N)
    tokens: as few as keep each group's working set (:data:`LEAN_WORKING_FLOATS`) within ``budget_bytes``."""
    heads = channels // head_dim
    working = LEAN_WORKING_FLOATS * tokens * channels * itemsize
    groups = min(heads, max(1, -(-working // max(budget_bytes, 1))))
    size = -(-heads // groups) * head_dim
    return [(lo, min(lo + size, channels)) for lo in range(0, channels, size)]


def to_rows(pairs: Tensor, batch: int, hw: tuple[int, int], packed: bool) -> Tensor:
    """Spectra (c, B, H, W//2+1, 2) of a ``batch`` of B H x W maps as real rows (c, B*R): their pairs,
    R = 2*H*(W//2+1), every map's after the other; with ``packed``, the N independent reals of each
    (:func:`cat.ops.spectral.pack_spectrum`). The sizes come from the grid, never from a spectrum: torch.export
    (and ONNX after it) cannot read a complex tensor's symbolic size."""
    H, W = hw
    if packed:
        return pack_spectrum(torch.view_as_complex(pairs.contiguous()), W).reshape(pairs.shape[0], batch * H * W)
    return pairs.reshape(pairs.shape[0], batch * H * (W // 2 + 1) * 2)


def to_pairs(rows: Tensor, batch: int, hw: tuple[int, int], packed: bool) -> Tensor:
    """The spectra (c, B, H, W//2+1, 2) of a ``batch`` of B that :func:`to_rows` made ``rows`` from (the sizes given,
    not inferred: under torch.export they are symbols)."""
    H, W = hw
    if packed:
        return torch.view_as_real(unpack_spectrum(rows.view(rows.shape[0], batch, H, W), W))
    return rows.view(rows.shape[0], batch, H, W // 2 + 1, 2)


def token_maps(tokens: Tensor, hw: tuple[int, int]) -> Tensor:
    """Tokens (B, N, c) as maps (c, B, H, W), channels outermost (a view)."""
    return tokens.permute(2, 0, 1).unflatten(-1, hw)


def map_tokens(maps: Tensor) -> Tensor:
    """Maps (c, B, H, W) as tokens (B, N, c) (a view)."""
    return maps.flatten(-2).permute(1, 2, 0)


def grid_rows(x: Tensor, prefix_tokens: int, hw: tuple[int, int], backend: DFTBackend, packed: bool) -> Tensor:
    """The spectrum of the grid tokens of x (B, P + N, C) as real rows (C, B*R) (:func:`to_rows`). The maps are
    made contiguous first: a transform of the strided view wrote its spectrum in x's layout, which the rows then
    copied, a larger copy (2*H*(W//2+1) reals per map against N)."""
    # A copy made unconditionally (not .contiguous(), whose check torch.export turns into guards on the batch size).
    maps = token_maps(x[:, prefix_tokens:], hw).clone(memory_format=torch.contiguous_format)
    return to_rows(rfft2(maps, backend, logits=True), x.shape[0], hw, packed)  # q's and k's spectra come from it


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


def projected_spectra(rows: Tensor, weight: Tensor, batch: int, hw: tuple[int, int], packed: bool) -> Tensor:
    """The spectra (O, B, H, W//2+1, 2) of the maps that a (O, C) ``weight`` projects from the maps whose spectra's
    rows are ``rows`` (C, B*R), B = ``batch``. The transform is linear, so projecting the spectrum equals
    transforming the projection: one transform of x gives q, k and v, with one GEMM for the whole batch (autocast
    may run it in bf16)."""
    return to_pairs((weight @ rows).to(rows.dtype), batch, hw, packed)


def _join(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass(frozen=True)
class _Settings:
    """The non-tensor arguments of one call, as the backward needs them."""

    hw: tuple[int, int]
    head_dim: int
    scale: float
    backend: DFTBackend
    packed: bool
    groups: list[tuple[int, int]]
    lean: bool


def _forward(x, qkv_weight, gate_pre, proj_weight, proj_bias, qkv_bias, prefix, s: _Settings, keep_spectra: bool):
    """Output (B, T, C), the attention output y (C, B, H, W) with v's bias, the weights omega (heads, B, H, W) by
    backward offset, and with ``keep_spectra`` what the backward needs besides (one group): the input spectrum's rows,
    q, k, v's spectra and the weights'."""
    B, T, C = x.shape
    P = T - s.hw[0] * s.hw[1]
    rows = grid_rows(x, P, s.hw, s.backend, s.packed)
    ys, omegas = [], []
    qkv = omega_f = None
    for lo, hi in s.groups:
        qkv = projected_spectra(rows, group_rows(qkv_weight, lo, hi), B, s.hw, s.packed)
        q_f, k_f, v_f = qkv.chunk(3)
        y, omega, omega_f = attend_spectra(q_f, k_f, v_f, s.hw, s.head_dim, s.scale, s.backend)
        ys.append(y)
        omegas.append(omega)
    y = _join(ys)
    if qkv_bias is not None:  # only v's part acts (circulant_attention_layer): a constant through the weights
        y = y + value_bias(qkv_bias, 0, C).view(C, 1, 1, 1).to(y.dtype)
    tokens = map_tokens(y)
    if gate_pre is None:
        u = torch.cat([prefix.to(tokens.dtype), tokens], dim=1) if P else tokens
    else:  # the gate multiplied into its own fresh buffer: one token-major transient, not two
        u = F.silu(gate_pre)
        u[:, P:].mul_(tokens)
        if P:
            u[:, :P].mul_(prefix)
    out = F.linear(u, proj_weight, proj_bias)
    kept = (rows, qkv, omega_f) if keep_spectra else ()
    return out, y, _join(omegas), kept


def _autocast_as(device: torch.device, state: tuple[bool, torch.dtype | None]) -> contextlib.AbstractContextManager:
    enabled, dtype = state
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=enabled)


class _CirculantAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, qkv_weight, gate_pre, proj_weight, proj_bias, qkv_bias, prefix, settings: _Settings):
        out, y, omega, kept = _forward(
            x, qkv_weight, gate_pre, proj_weight, proj_bias, qkv_bias, prefix, settings, not settings.lean
        )
        stored = () if settings.lean else (*kept, y, omega)
        ctx.save_for_backward(x, qkv_weight, gate_pre, proj_weight, qkv_bias, prefix, *stored)
        ctx.settings = settings
        ctx.has_bias = proj_bias is not None
        ctx.autocast = autocast_state(x.device)
        ctx.mark_non_differentiable(omega)
        ctx.set_materialize_grads(False)  # the weights get no gradient: no zeros made for it
        return out, omega

    @staticmethod
    def backward(ctx, g_out: Tensor, _g_omega: Tensor | None):
        x, qkv_weight, gate_pre, proj_weight, qkv_bias, prefix, *stored = ctx.saved_tensors
        if g_out is None:  # grads are not materialised: none reached the output
            return (None,) * 8
        s: _Settings = ctx.settings
        hw, head_dim, backend = s.hw, s.head_dim, s.backend
        B, T, C = x.shape
        N = hw[0] * hw[1]
        P = T - N
        device = x.device
        one_group = len(s.groups) == 1
        with _autocast_as(device, ctx.autocast):
            rows = grid_rows(x, P, hw, backend, s.packed) if s.lean else stored[0]
            work = rows.dtype
            g_u = torch.matmul(g_out, proj_weight)  # the gradient of the projection's input
            g_out_tokens = g_out[:, P:].reshape(B * N, -1)
            # The qkv weight's gradient from the gradient spectra and x's (Parseval): no inverse transform per group.
            weighted = (rows.view(C, B, -1) * parseval_weights(hw, s.packed, work, device)).view(C, -1)
            g_rows = None
            g_qkv_weight = qkv_weight.new_empty(qkv_weight.shape, dtype=work) if not one_group else None
            g_proj_weight = proj_weight.new_empty(proj_weight.shape, dtype=work) if not one_group else None
            g_gate_pre = None
            if gate_pre is not None and (P or not one_group):
                g_gate_pre = torch.empty_like(gate_pre)
            g_qkv_bias = torch.zeros_like(qkv_bias, dtype=work) if qkv_bias is not None else None  # q's, k's: 0
            for lo, hi in s.groups:
                c = hi - lo
                if s.lean:  # recompute what the forward did not keep
                    qkv = projected_spectra(rows, group_rows(qkv_weight, lo, hi), B, hw, s.packed)
                    q_f, k_f, v_f = qkv.chunk(3)
                    y, omega, omega_f = attend_spectra(q_f, k_f, v_f, hw, head_dim, s.scale, backend)
                    if qkv_bias is not None:
                        y = y + value_bias(qkv_bias, lo, hi).view(c, 1, 1, 1).to(work)
                else:
                    qkv, omega_f, y, omega = stored[1:]
                    q_f, k_f, v_f = qkv.chunk(3)
                # Through the projection and the gate, token-major (B, N, c), as the gate's pre-activation lies.
                y_t = map_tokens(y)
                g_u_g = g_u[:, P:, lo:hi]
                if gate_pre is not None:
                    z = gate_pre[:, P:, lo:hi]
                    gate = F.silu(z)
                    g_z = torch.ops.aten.silu_backward(g_u_g * y_t, z)
                    if g_gate_pre is None:  # one group and no prefix tokens: the whole gradient
                        g_gate_pre = g_z.to(gate_pre.dtype)
                    else:
                        g_gate_pre[:, P:, lo:hi] = g_z
                    g_y, u = g_u_g * gate, gate * y_t
                else:
                    g_y, u = g_u_g, y_t
                g_p = g_out_tokens.t() @ u.reshape(B * N, c)
                if g_proj_weight is None:
                    g_proj_weight = g_p
                else:
                    g_proj_weight[:, lo:hi] = g_p
                # Through the circulant attention, in the frequency domain.
                g_f = rfft2(token_maps(g_y, hw), backend)
                if g_qkv_bias is not None:  # v's bias: g_y summed over the tokens, its spectrum at frequency 0
                    value_bias(g_qkv_bias, lo, hi).copy_(g_f[:, :, 0, 0, 0].sum(1))
                g_v = per_head(omega_f, g_f, head_dim, conj=True)
                g_omega = irfft2(head_sum(conj_mul(v_f, g_f), head_dim), hw, backend)
                g_lambda = torch._softmax_backward_data(g_omega.flatten(-2), omega.flatten(-2), -1, omega.dtype).view(
                    omega.shape
                )
                lam = rfft2(g_lambda * s.scale, backend)
                g_qkv = to_rows(
                    torch.cat([per_head(lam, k_f, head_dim), per_head(lam, q_f, head_dim, conj=True), g_v]),
                    B,
                    hw,
                    s.packed,
                )
                # Through the qkv projection, on the spectrum's rows: one GEMM each for the whole batch.
                g_w = g_qkv @ weighted.t()
                if g_qkv_weight is None:
                    g_qkv_weight = g_w
                else:
                    set_group_rows(g_qkv_weight, lo, hi, g_w)
                contribution = group_rows(qkv_weight, lo, hi).t() @ g_qkv
                g_rows = contribution if g_rows is None else g_rows + contribution
            # There is at least one group.
            assert g_rows is not None and g_qkv_weight is not None and g_proj_weight is not None
            g_prefix = None
            if P:  # the prefix rows: through the projection and the gate only
                u = prefix.to(work)
                g_prefix = g_u[:, :P].to(work)
                if gate_pre is not None and g_gate_pre is not None:
                    z = gate_pre[:, :P]
                    g_gate_pre[:, :P] = torch.ops.aten.silu_backward(g_prefix * u, z)
                    gate = F.silu(z)
                    g_prefix, u = g_prefix * gate, u * gate
                g_proj_weight += torch.matmul(g_out[:, :P].transpose(1, 2).to(work), u).sum(0)
                g_prefix = g_prefix.to(prefix.dtype)
            g_grid = map_tokens(irfft2(to_pairs(g_rows, B, hw, s.packed), hw, backend))  # a view: autograd adds it so
            if P:  # x's prefix rows reach the output only through the caller's own ops: zeros beside the grid's
                g_x = torch.cat([g_grid.new_zeros(B, P, C), g_grid], dim=1)
            else:
                g_x = g_grid
            g_proj_bias = g_out.sum((0, 1)) if ctx.has_bias else None
        return (
            g_x.to(x.dtype),
            g_qkv_weight.to(qkv_weight.dtype),
            g_gate_pre,
            g_proj_weight.to(proj_weight.dtype),
            g_proj_bias.to(proj_weight.dtype) if g_proj_bias is not None else None,
            g_qkv_bias.to(qkv_bias.dtype) if g_qkv_bias is not None else None,
            g_prefix,
            None,
        )


def circulant_attention_function(
    x: Tensor,
    qkv_weight: Tensor,
    gate_pre: Tensor | None,
    proj_weight: Tensor,
    proj_bias: Tensor | None,
    hw: tuple[int, int],
    head_dim: int,
    scale: float,
    backend: DFTBackend = "fft",
    lean: bool = False,
    budget_bytes: int = 2**62,
    keep_weights: bool = False,
    packed: bool = False,
    qkv_bias: Tensor | None = None,
    prefix: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """proj(CirAttn(x W_q, x W_k, x W_v) * SiLU(gate_pre)) for tokens x (B, N, C) on an ``hw`` grid, and with
    ``keep_weights`` the attention weights (B, heads, H, W) by offset, not differentiable (else an empty tensor).
    ``gate_pre`` None: no gate. ``lean``: keep only x and ``gate_pre`` for the backward, recomputing the rest in
    channel groups of at most ``budget_bytes`` working set (else keep the spectra, one group). ``qkv_bias`` (3C,):
    q, k, v with a bias (timm's ``qkv_bias=True`` models, converted by :func:`cat.convert`), of which only v's part
    acts
    (:func:`cat.ops.circulant.circulant_attention_layer` says why); q's and k's get zero gradient. ``prefix``
    (B, P, C): the attention outputs of P tokens that precede the grid (a converted ViT's class and register tokens,
    whose softmax attention the caller computes); x and ``gate_pre`` then hold those tokens first, (B, P + N, C),
    and the output covers all of them, gated and projected alike. ``packed``: the qkv GEMM runs on each spectrum's N
    independent reals instead of its 2*H*(W//2+1) (docs/perf.md compares the two). Checks of shapes and arguments
    are the caller's (:class:`cat.ops.CirculantAttention`)."""
    B, T, C = x.shape
    tokens = B * (T - (0 if prefix is None else prefix.shape[1]))
    groups = channel_groups(C, head_dim, tokens, fft_itemsize(x.dtype), budget_bytes) if lean else [(0, C)]
    settings = _Settings(hw, head_dim, scale, backend, packed, groups, lean)
    tensors = (x, qkv_weight, gate_pre, proj_weight, proj_bias, qkv_bias, prefix)
    needs_grad = any(t is not None and t.requires_grad for t in tensors)
    # A trace (torch.jit.trace) cannot record the autograd.Function: it records the forward's plain operators.
    if torch.is_grad_enabled() and needs_grad and not torch.jit.is_tracing():
        out, omega = _training(*tensors, settings)
    else:  # inference: no autograd.Function, nothing kept
        out, _, omega, _ = _forward(*tensors, settings, keep_spectra=False)
    if not keep_weights:
        return out, omega.narrow(0, 0, 0)  # empty: a view, no kernel
    return out, weights_by_offset(omega).transpose(0, 1)


def _training(*args) -> tuple[Tensor, Tensor]:
    settings: _Settings = args[-1]
    if settings.lean and torch.compiler.is_compiling():
        return _lean_uncompiled(*args)
    return _CirculantAttentionFunction.apply(*args)


# Traced, AOTAutograd's common-subexpression pass merges the lean backward's recomputation with the forward, which
# then keeps its intermediates after all (CA-DeiT-T at 224^2, B=32: 1244 MiB kept, 819 eagerly); so torch.compile
# calls the lean function as it is. The stored one is traced and compiled whole.
@torch.compiler.disable(reason="the lean function recomputes in its backward what a traced forward would keep")
def _lean_uncompiled(*args) -> tuple[Tensor, Tensor]:
    return _CirculantAttentionFunction.apply(*args)
