"""Circulant attention with its token gate and output projection as one autograd function whose backward is
written in the frequency domain: a fixed number of operators per block, however large the batch.

What the backward starts from (``lean``):
  stored  the forward keeps the input's maps, the spectra of q, k, v, the weights, their spectrum and the output
          (:func:`stored_floats`); the backward recomputes only the gate. The faster of the two; ``auto`` takes it
          where the memory allows.
  lean    the forward keeps only x and the gate's pre-activation; the backward recomputes the rest, so training
          holds less than softmax attention would. It works through the channels in groups sized by a memory budget
          in bytes (:func:`channel_groups`): one group, and so a fixed operator count, unless the budget is smaller
          than the block's working set.
Each group's stages run over all its channels at once (batched transforms and GEMMs).

Spectra are orthonormal (``norm="ortho"``), as the released model computes them: the released scale 1/sqrt(N) then
costs no product, forward or backward (:func:`cat.ops.spectral.logit_factor`). With the weights omega by backward
offset (:func:`cat.ops.spectral.circulant_weights`), y = irfft(F(omega) V) per channel, so with G = F(g_y) and
Lambda = F(g_lambda) (orthonormal):
    F(g_v) = conj(F omega) G,      g_omega = N irfft(conj(V) G),      g_lambda = scale * softmax'(g_omega),
    F(g_q) = Lambda K,             F(g_k) = conj(Lambda) Q,
and one inverse transform of the three gradient spectra gives the gradients of q, k and v as maps, from which two
GEMMs give the qkv weight's gradient and x's, with the maps of x the forward made.

Dtypes: the transforms, the products between them and the qkv projection run in float32 (float64 for float64 inputs):
the softmax logits need the range, and a float32 GEMM takes no cast. Under autocast the gate and the projection run
in autocast's dtype, with the projection's weights cast once per step, and the input is cast with the copy into maps
that the transform takes anyway.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .dft import DFTBackend, irfft2, is_unit, rfft2
from .policy import compute_dtype
from .precision import autocast_state, fft_dtype, fft_itemsize, no_autocast
from .spectral import (
    attend_spectra,
    conj_mul,
    head_sum,
    logit_factor,
    pack_spectrum,
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
    """Floats the stored path keeps for the backward of a block of ``tokens`` (B*N) tokens: the maps of x, the spectra
    of q, k, v (2*H*(W//2+1) reals per map of N), the weights and their spectrum, the attention output and the
    projection's input."""
    H, W = hw
    spectrum = tokens * 2 * (W // 2 + 1) * H // (H * W)  # reals per map's spectrum, over the batch
    return (3 * channels + heads) * spectrum + heads * tokens + 3 * channels * tokens


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


def grid_maps(x: Tensor, prefix_tokens: int, hw: tuple[int, int]) -> Tensor:
    """The grid tokens of x (B, P + N, C) as contiguous maps (C, B, H, W) in the transforms' dtype: one copy, which
    casts too (a half-precision x under autocast). A transform of the strided view wrote its spectrum in x's layout,
    which the rows then copied, a larger copy (2*H*(W//2+1) reals per map against N). Made unconditionally (not
    ``.contiguous()``, whose check torch.export turns into guards on the batch size)."""
    maps = token_maps(x[:, prefix_tokens:], hw)
    return maps.to(fft_dtype(x.dtype), memory_format=torch.contiguous_format, copy=True)


def map_rows(maps: Tensor, hw: tuple[int, int], backend: DFTBackend, packed: bool) -> Tensor:
    """The orthonormal spectra of ``maps`` (C, B, H, W) as real rows (C, B*R) (:func:`to_rows`): q's and k's spectra
    come from them, so their GEMMs, if any, run in float32."""
    return to_rows(rfft2(maps, backend, logits=True, norm="ortho"), maps.shape[1], hw, packed)


def grid_rows(x: Tensor, prefix_tokens: int, hw: tuple[int, int], backend: DFTBackend, packed: bool) -> Tensor:
    """The spectrum of the grid tokens of x (B, P + N, C) as real rows (C, B*R) (:func:`grid_maps`,
    :func:`map_rows`)."""
    return map_rows(grid_maps(x, prefix_tokens, hw), hw, backend, packed)


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
    transforming the projection: one transform of x gives q, k and v, with one GEMM for the whole batch, in the rows'
    dtype whatever autocast says (the logits need float32; the weight is float32 already: no cast)."""
    with no_autocast(rows.device):
        return to_pairs(weight.to(rows.dtype) @ rows, batch, hw, packed)


def _join(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass(frozen=True)
class _Settings:
    """The non-tensor arguments of one call, as the backward needs them."""

    hw: tuple[int, int]
    head_dim: int
    scale: float | None  # None: the released 1 / sqrt(N * head_dim)
    backend: DFTBackend
    packed: bool
    groups: list[tuple[int, int]]
    lean: bool


def _gated_tokens(y: Tensor, gate_pre: Tensor | None, prefix: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The projection's input u = y * SiLU(gate_pre) (B, T, C) in ``dtype`` for the attention output y (C, B, H, W),
    and the P prefix tokens' outputs before it: the gate multiplied into its own fresh buffer, one token-major
    transient."""
    tokens = map_tokens(y)
    P = 0 if prefix is None else prefix.shape[1]
    if gate_pre is None:
        return torch.cat([prefix, tokens], dim=1).to(dtype) if prefix is not None and P else tokens.to(dtype)
    u = F.silu(gate_pre)
    u[:, P:].mul_(tokens)
    if prefix is not None and P:
        u[:, :P].mul_(prefix)
    return u


def _forward(x, qkv_weight, gate_pre, proj_weight, proj_bias, qkv_bias, prefix, s: _Settings):
    """Output (B, T, C), the weights omega (heads, B, H, W) by backward offset, and what the stored backward starts
    from (one group): the maps of x, q, k, v's spectra, the weights' spectrum, the attention output y (C, B, H, W)
    with v's bias and the projection's input. The gate's pre-activation, ``proj_weight`` and ``proj_bias`` are in
    the compute dtype."""
    B, T, C = x.shape
    maps = grid_maps(x, T - s.hw[0] * s.hw[1], s.hw)
    rows = map_rows(maps, s.hw, s.backend, s.packed)
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
    u = _gated_tokens(y, gate_pre, prefix, proj_weight.dtype)
    with no_autocast(x.device):  # the weights are in the compute dtype already
        out = F.linear(u, proj_weight, proj_bias)
    return out, _join(omegas), (maps, qkv, omega_f, y, u)


def _autocast_as(device: torch.device, state: tuple[bool, torch.dtype | None]) -> contextlib.AbstractContextManager:
    enabled, dtype = state
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=enabled)


def _in_dtype(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if t is None else t.to(dtype)


def _gate_and_forward(x, qkv_weight, gate_weight, gate_bias, proj_weight, proj_bias, qkv_bias, prefix, settings):
    """:func:`_forward` from the parameters: the gate's and the projection's weights cast once to the compute dtype
    (autocast's, else x's), and the gate's pre-activation (B, T, C) in it. Returns the output, the weights, the
    gate's pre-activation, the cast projection weight and :func:`_forward`'s kept tensors."""
    compute = compute_dtype(x)
    proj_w = proj_weight.to(compute)
    gate_pre = None
    with no_autocast(x.device):  # the dtypes are set here
        if gate_weight is not None:
            gate_pre = F.linear(x.to(compute), gate_weight.to(compute), _in_dtype(gate_bias, compute))
    out, omega, kept = _forward(
        x, qkv_weight, gate_pre, proj_w, _in_dtype(proj_bias, compute), qkv_bias, _in_dtype(prefix, compute), settings
    )
    return out, omega, gate_pre, proj_w, kept


class _CirculantAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, qkv_weight, gate_weight, gate_bias, proj_weight, proj_bias, qkv_bias, prefix, settings):
        out, omega, gate_pre, proj_w, kept = _gate_and_forward(
            x, qkv_weight, gate_weight, gate_bias, proj_weight, proj_bias, qkv_bias, prefix, settings
        )
        stored = () if settings.lean else (*kept, omega)
        ctx.save_for_backward(x, qkv_weight, gate_weight, gate_pre, proj_w, qkv_bias, prefix, *stored)
        ctx.settings = settings
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (gate_bias, proj_weight, proj_bias))
        ctx.autocast = autocast_state(x.device)
        ctx.mark_non_differentiable(omega)
        ctx.set_materialize_grads(False)  # the weights get no gradient: no zeros made for it
        return out, omega

    @staticmethod
    def backward(ctx, g_out: Tensor, _g_omega: Tensor | None):
        x, qkv_weight, gate_weight, gate_pre, proj_w, qkv_bias, prefix, *stored = ctx.saved_tensors
        if g_out is None:  # grads are not materialised: none reached the output
            return (None,) * 9
        s: _Settings = ctx.settings
        hw, head_dim, backend = s.hw, s.head_dim, s.backend
        B, T, C = x.shape
        N = hw[0] * hw[1]
        P = T - N
        device = x.device
        one_group = len(s.groups) == 1
        factor = logit_factor(hw, head_dim, s.scale)
        g_out = g_out.to(proj_w.dtype)
        u = None
        with _autocast_as(device, ctx.autocast):  # for the GEMM DFTs, which run in autocast's dtype
            if s.lean:
                maps = grid_maps(x, P, hw)
                rows = map_rows(maps, hw, backend, s.packed)
            else:
                maps, qkv, omega_f, y, u, omega = stored
            work = maps.dtype
            with no_autocast(device):
                g_u = torch.matmul(g_out, proj_w)  # the gradient of the projection's input
                # The projection's weight: at once from its kept input, else per group and for the prefix rows.
                g_proj_weight = g_out.reshape(B * T, C).t() @ u.reshape(B * T, C) if u is not None else None
            if g_proj_weight is None and not one_group:
                g_proj_weight = proj_w.new_empty(proj_w.shape)
            g_out_tokens = g_out[:, P:].reshape(B * N, C)
            g_grid = g_qkv_weight = g_gate_pre = None
            if not one_group:
                g_qkv_weight = qkv_weight.new_empty(qkv_weight.shape, dtype=work)
            if gate_pre is not None and (P or not one_group):
                g_gate_pre = gate_pre.new_empty(gate_pre.shape, dtype=work)
            g_qkv_bias = torch.zeros_like(qkv_bias, dtype=work) if qkv_bias is not None else None  # q's, k's: 0
            for lo, hi in s.groups:
                c = hi - lo
                if s.lean:  # recompute what the forward did not keep
                    qkv = projected_spectra(rows, group_rows(qkv_weight, lo, hi), B, hw, s.packed)
                    if one_group:
                        del rows
                    q_f, k_f, v_f = qkv.chunk(3)
                    y, omega, omega_f = attend_spectra(q_f, k_f, v_f, hw, head_dim, s.scale, backend)
                    if qkv_bias is not None:
                        y = y + value_bias(qkv_bias, lo, hi).view(c, 1, 1, 1).to(work)
                # Through the projection and the gate, token-major (B, N, c), as the gate's pre-activation lies.
                # Each intermediate is dropped once used, from here on: the lean function's peak is in this loop.
                y_t = map_tokens(y)
                del y
                g_u_g = g_u[:, P:, lo:hi]
                gate = None
                if gate_pre is not None:
                    z = gate_pre[:, P:, lo:hi]
                    gate = F.silu(z)
                    g_z = torch.ops.aten.silu_backward(g_u_g * y_t, z)
                    if g_gate_pre is None:  # one group and no prefix tokens: the whole gradient
                        g_gate_pre = g_z
                    else:
                        g_gate_pre[:, P:, lo:hi] = g_z
                    del g_z
                if u is None:
                    u_g = y_t if gate is None else gate * y_t
                    with no_autocast(device):
                        g_p = g_out_tokens.t() @ u_g.reshape(B * N, c).to(g_out.dtype)
                    del u_g
                    if g_proj_weight is None:
                        g_proj_weight = g_p
                    else:
                        g_proj_weight[:, lo:hi] = g_p
                del y_t
                # Through the circulant attention, in the frequency domain (the module docstring has the formulas).
                g_f = rfft2(token_maps(g_u_g if gate is None else g_u_g * gate, hw).to(work), backend, norm="ortho")
                del gate
                q_f, k_f, v_f = qkv.chunk(3)
                g_v = per_head(omega_f, g_f, head_dim, conj=True)
                g_omega = irfft2(head_sum(conj_mul(v_f, g_f), head_dim), hw, backend, norm="forward")
                del g_f, omega_f, v_f
                g_lambda = torch._softmax_backward_data(g_omega.flatten(-2), omega.flatten(-2), -1, omega.dtype)
                del g_omega, omega
                lam = rfft2(g_lambda.unflatten(-1, hw), backend, norm="ortho")
                del g_lambda
                if not is_unit(factor):
                    lam = lam * factor
                g_spectra = torch.cat([per_head(lam, k_f, head_dim), per_head(lam, q_f, head_dim, conj=True), g_v])
                del lam, g_v, q_f, k_f, qkv
                # The gradients of q, k and v as maps (3c, B*N): through the qkv projection with one GEMM each for the
                # weight (against the maps of x) and for x.
                g_qkv = irfft2(g_spectra, hw, backend, norm="ortho").reshape(3 * c, B * N)
                del g_spectra
                if g_qkv_bias is not None:  # v's bias: g_v summed over the tokens
                    value_bias(g_qkv_bias, lo, hi).copy_(g_qkv[2 * c :].sum(1))
                with no_autocast(device):
                    g_w = g_qkv @ maps.view(C, B * N).t()
                    contribution = g_qkv.t() @ group_rows(qkv_weight, lo, hi).to(work)
                if g_qkv_weight is None:
                    g_qkv_weight = g_w
                else:
                    set_group_rows(g_qkv_weight, lo, hi, g_w)
                g_grid = contribution if g_grid is None else g_grid + contribution
            # There is at least one group.
            assert g_grid is not None and g_qkv_weight is not None and g_proj_weight is not None
            g_prefix = None
            if P:  # the prefix rows: through the projection and the gate only
                v_p = prefix.to(work)
                g_prefix = g_u[:, :P].to(work)
                if gate_pre is not None and g_gate_pre is not None:
                    z = gate_pre[:, :P]
                    g_gate_pre[:, :P] = torch.ops.aten.silu_backward(g_prefix * v_p, z)
                    gate = F.silu(z)
                    g_prefix, v_p = g_prefix * gate, v_p * gate
                if u is None:
                    g_p = torch.matmul(g_out[:, :P].transpose(1, 2).to(work), v_p).sum(0)
                    g_proj_weight += g_p.to(g_proj_weight.dtype)
                g_prefix = g_prefix.to(prefix.dtype)
            g_gate_weight = g_gate_bias = None
            with no_autocast(device):
                if g_gate_pre is not None:  # the gate's linear: its weight's gradient against the maps of x, and x's
                    g_z = g_gate_pre.reshape(B, T, C)
                    g_z_grid = g_z[:, P:].reshape(B * N, C)
                    g_gate_weight = g_z_grid.t() @ maps.view(C, B * N).t()
                    if P:
                        g_gate_weight += (g_z[:, :P].transpose(1, 2) @ x[:, :P].to(work)).sum(0)
                    g_gate_bias = g_z.sum((0, 1)) if ctx.dtypes[0] is not None else None
                    g_grid = torch.addmm(g_grid, g_z_grid, gate_weight.to(work))
            g_grid = g_grid.view(B, N, C)
            if P:  # x's prefix rows: through the gate's linear alone (the prefix outputs are the caller's)
                if g_gate_pre is not None:
                    g_head = g_gate_pre[:, :P] @ gate_weight.to(work)
                else:
                    g_head = g_grid.new_zeros(B, P, C)
                g_x = torch.cat([g_head, g_grid], dim=1)
            else:
                g_x = g_grid
            gate_bias_dtype, weight_dtype, bias_dtype = ctx.dtypes
            g_proj_bias = g_out.sum((0, 1), dtype=bias_dtype) if bias_dtype is not None else None
        return (
            g_x.to(x.dtype),
            g_qkv_weight.to(qkv_weight.dtype),
            _in_dtype(g_gate_weight, gate_weight.dtype) if gate_weight is not None else None,
            _in_dtype(g_gate_bias, gate_bias_dtype) if gate_bias_dtype is not None else None,
            g_proj_weight.to(weight_dtype),
            g_proj_bias,
            g_qkv_bias.to(qkv_bias.dtype) if g_qkv_bias is not None else None,
            g_prefix,
            None,
        )


def circulant_attention_function(
    x: Tensor,
    qkv_weight: Tensor,
    gate_weight: Tensor | None,
    gate_bias: Tensor | None,
    proj_weight: Tensor,
    proj_bias: Tensor | None,
    hw: tuple[int, int],
    head_dim: int,
    scale: float | None,
    backend: DFTBackend = "fft",
    lean: bool = False,
    budget_bytes: int = 2**62,
    keep_weights: bool = False,
    packed: bool = False,
    qkv_bias: Tensor | None = None,
    prefix: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """proj(CirAttn(x W_q, x W_k, x W_v) * SiLU(x W_g^T + b_g)) for tokens x (B, N, C) on an ``hw`` grid, and with
    ``keep_weights`` the attention weights (B, heads, H, W) by offset, not differentiable (else an empty tensor).
    ``gate_weight`` None: no gate. ``lean``: keep only x and the gate's pre-activation for the backward, recomputing
    the rest in channel groups of at most ``budget_bytes`` working set (else keep the spectra, one group).
    ``qkv_bias`` (3C,): q, k, v with a bias (timm's ``qkv_bias=True`` models, converted by :func:`cat.convert`), of
    which only v's part acts (:func:`cat.ops.circulant.circulant_attention_layer` says why); q's and k's get zero
    gradient. ``prefix`` (B, P, C): the attention outputs of P tokens that precede the grid (a converted ViT's class
    and register tokens, whose softmax attention the caller computes); x then holds those tokens first, (B, P + N, C),
    and the output covers all of them, gated and projected alike. ``packed``: the qkv GEMM runs on each spectrum's N
    independent reals instead of its 2*H*(W//2+1) (docs/perf.md compares the two). Checks of shapes and arguments
    are the caller's (:class:`cat.ops.CirculantAttention`)."""
    B, T, C = x.shape
    tokens = B * (T - (0 if prefix is None else prefix.shape[1]))
    groups = channel_groups(C, head_dim, tokens, fft_itemsize(x.dtype), budget_bytes) if lean else [(0, C)]
    settings = _Settings(hw, head_dim, scale, backend, packed, groups, lean)
    tensors = (x, qkv_weight, gate_weight, gate_bias, proj_weight, proj_bias, qkv_bias, prefix)
    needs_grad = any(t is not None and t.requires_grad for t in tensors)
    # A trace (torch.jit.trace) cannot record the autograd.Function: it records the forward's plain operators.
    if torch.is_grad_enabled() and needs_grad and not torch.jit.is_tracing():
        out, omega = _training(*tensors, settings)
    else:  # inference: no autograd.Function, nothing kept
        out, omega, *_ = _gate_and_forward(*tensors, settings)
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
