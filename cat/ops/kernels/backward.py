"""Circulant attention's backward as one kernel: it recomputes what the forward did not keep, from q, k, v and the
forward's log-sum-exp per head, as flash attention's backward does, and writes the gradients of q, k and v.

What a program holds: one head of one image (:mod:`.forward`), with the gradient g of its output. In the forward,
logits_d = scale sum_i q_i k_{i+d}, w = softmax(logits), out_i = sum_d w_d v_{i+d}; so, with G = DFT(g):

    each channel c:          L += conj(DFT q_c) DFT k_c;  logits = scale IDFT(L)      (as the forward: 12 GEMMs)
                             w = exp(logits - lse), Wf = DFT(w)    (the forward's weights, recomputed)
    each channel c:          Gw += conj(G_c) DFT v_c               (12 GEMMs a channel)
    g_w = IDFT(Gw)           (dL/dw_d = sum_c sum_i g_i v_{i+d})
    g_l = w (g_w - sum_d w_d g_w,d)                                (the softmax's backward, float32)
    Wf, Lf = DFT(w), DFT(g_l)
    each channel c:          g_v = IDFT(G_c Wf)                    (sum_i g_i w_{j-i})
                             g_q = scale IDFT(conj(Lf) DFT k_c)    (sum_d g_l,d k_{i+d})
                             g_k = scale IDFT(Lf DFT q_c)          (sum_d g_l,d q_{j-d})     (48 GEMMs a channel)

With ``GATED`` (the forward wrote out_c SiLU(a_c)) the gradient that reaches the attention is g_c SiLU(a_c), and the
gate's is g_c out_c SiLU'(a_c): the ungated out_c = IDFT(conj(Wf) DFT v_c) is recomputed beside Gw's transform of v_c
(6 GEMMs more a channel), and the gate's gradient written there, as channels [3C, 4C) of the projection's.

Nothing of size N x N or any spectrum goes to memory: each gradient is written once, into the gradient of the qkv
projection's output (B, N, 3C), as soon as it is made (fewer tiles live at once).
"""

from __future__ import annotations

import triton.language as tl

from .tiles import forward_dft, gate_of, head_logits, inverse_dft, map_offsets, silu, silu_derivative, tile_sum


def circulant_backward_kernel(
    g_ptr,
    qkv_ptr,
    gate_bias_ptr,
    lse_ptr,
    grad_ptr,
    H,
    W,
    heads,
    C,
    scale,
    stride_gb,
    stride_gn,
    stride_gc,
    stride_b,
    stride_n,
    stride_c,
    stride_ob,
    stride_on,
    stride_oc,
    BH: tl.constexpr,
    BW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    GATED: tl.constexpr,
    GATE_BIAS: tl.constexpr,
):
    program = tl.program_id(0)
    b = program // heads
    head = program % heads
    n_inv = 1.0 / (H * W)
    g_offsets, mask = map_offsets(H, W, BH, BW, stride_gn)
    offsets, _ = map_offsets(H, W, BH, BW, stride_n)
    o_offsets, _ = map_offsets(H, W, BH, BW, stride_on)
    base = qkv_ptr + b * stride_b + offsets
    g_base = g_ptr + b * stride_gb + g_offsets
    out_base = grad_ptr + b * stride_ob + o_offsets
    dtype = grad_ptr.dtype.element_ty
    first = head * HEAD_DIM
    logits = head_logits(base, stride_c, first, C, mask, H, W, BH, BW, HEAD_DIM, scale, PRECISION)
    lse = tl.load(lse_ptr + program)
    w = tl.where(mask, tl.exp(logits - lse), 0.0)
    wr, wi = forward_dft(w, H, W, BH, BW, PRECISION)
    gwr = tl.full((BH, BW), 0.0, tl.float32)
    gwi = tl.full((BH, BW), 0.0, tl.float32)
    for c in range(first, first + HEAD_DIM):
        g = tl.load(g_base + c * stride_gc, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(base + (2 * C + c) * stride_c, mask=mask, other=0.0).to(tl.float32)
        vr, vi = forward_dft(v, H, W, BH, BW, PRECISION)
        if GATED:
            a = gate_of(base + (3 * C + c) * stride_c, gate_bias_ptr + c, mask, GATE_BIAS)
            out = inverse_dft(wr * vr + wi * vi, wr * vi - wi * vr, H, W, BH, BW, n_inv, PRECISION)
            g_gate = g * out * silu_derivative(a)
            tl.store(out_base + (3 * C + c) * stride_oc, g_gate.to(dtype), mask=mask)
            g = g * silu(a)
        gr, gi = forward_dft(g, H, W, BH, BW, PRECISION)
        gwr += gr * vr + gi * vi
        gwi += gr * vi - gi * vr
    g_w = inverse_dft(gwr, gwi, H, W, BH, BW, n_inv, PRECISION)
    inner = tile_sum(w * g_w)
    g_l = tl.where(mask, w * (g_w - inner), 0.0)
    glr, gli = forward_dft(g_l, H, W, BH, BW, PRECISION)
    for c in range(first, first + HEAD_DIM):
        g = tl.load(g_base + c * stride_gc, mask=mask, other=0.0).to(tl.float32)
        if GATED:
            g = g * silu(gate_of(base + (3 * C + c) * stride_c, gate_bias_ptr + c, mask, GATE_BIAS))
        gr, gi = forward_dft(g, H, W, BH, BW, PRECISION)
        g_v = inverse_dft(gr * wr - gi * wi, gr * wi + gi * wr, H, W, BH, BW, n_inv, PRECISION)
        tl.store(out_base + (2 * C + c) * stride_oc, g_v.to(dtype), mask=mask)
        k = tl.load(base + (C + c) * stride_c, mask=mask, other=0.0).to(tl.float32)
        kr, ki = forward_dft(k, H, W, BH, BW, PRECISION)
        g_q = inverse_dft(glr * kr + gli * ki, glr * ki - gli * kr, H, W, BH, BW, n_inv * scale, PRECISION)
        tl.store(out_base + c * stride_oc, g_q.to(dtype), mask=mask)
        q = tl.load(base + c * stride_c, mask=mask, other=0.0).to(tl.float32)
        qr, qi = forward_dft(q, H, W, BH, BW, PRECISION)
        g_k = inverse_dft(glr * qr - gli * qi, glr * qi + gli * qr, H, W, BH, BW, n_inv * scale, PRECISION)
        tl.store(out_base + (C + c) * stride_oc, g_k.to(dtype), mask=mask)
