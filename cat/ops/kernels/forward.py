"""Circulant attention's forward as one kernel: q, k, v read once, the output and one log-sum-exp per head written.

What a program holds: one head of one image, its maps on the H x W grid as BH x BW tiles (:mod:`.tiles`), all in
registers and never written out: the spectrum of the logits summed over the head's channels, the logits, the
softmax weights and their spectrum, and one channel's spectra at a time.

    for each channel c of the head:   Q, K = DFT(q_c), DFT(k_c);   L += conj(Q) K        (12 GEMMs a channel)
    logits = scale * IDFT(L)          (the circular cross-correlation sum_i q_i k_{i+d}, 6 GEMMs)
    w = softmax(logits) over the N = H W offsets, in float32; lse = its log-sum-exp (stored: (B, heads))
    Wf = DFT(w)                       (6 GEMMs)
    for each channel c:               out_c = IDFT(conj(Wf) DFT(v_c))   (out_i = sum_d w_d v_{i+d}, 12 GEMMs)
                                      out_c *= SiLU(gate_c)     (GATED: the token post-reweighting, in the epilogue)

Tokens are read where they lie: the qkv projection's output (B, N, 3C), q, k and v its channels [0, C), [C, 2C) and
[2C, 3C), any strides, each map's entries ``stride_n`` apart; the accumulation and the softmax are in float32
whatever the inputs' dtype. With ``GATED`` the projection also made the gate's pre-activation, its channels
[3C, 4C) (B, N, 4C: one GEMM for the four), and ``GATE_BIAS`` adds the gate's bias to it here; the output is written
gated, so neither the ungated output nor the gate's activation goes to memory.
"""

from __future__ import annotations

import triton.language as tl

from .tiles import forward_dft, gate_of, head_logits, inverse_dft, map_offsets, silu, softmax_of


def circulant_forward_kernel(
    qkv_ptr,
    gate_bias_ptr,
    out_ptr,
    lse_ptr,
    H,
    W,
    heads,
    C,
    scale,
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
    offsets, mask = map_offsets(H, W, BH, BW, stride_n)
    o_offsets, _ = map_offsets(H, W, BH, BW, stride_on)
    base = qkv_ptr + b * stride_b + offsets
    first = head * HEAD_DIM
    logits = head_logits(base, stride_c, first, C, mask, H, W, BH, BW, HEAD_DIM, scale, PRECISION)
    w, lse = softmax_of(logits, mask)
    tl.store(lse_ptr + program, lse)
    wr, wi = forward_dft(w, H, W, BH, BW, PRECISION)
    for c in range(first, first + HEAD_DIM):
        v = tl.load(base + (2 * C + c) * stride_c, mask=mask, other=0.0).to(tl.float32)
        vr, vi = forward_dft(v, H, W, BH, BW, PRECISION)
        out = inverse_dft(wr * vr + wi * vi, wr * vi - wi * vr, H, W, BH, BW, n_inv, PRECISION)
        if GATED:
            out = out * silu(gate_of(base + (3 * C + c) * stride_c, gate_bias_ptr + c, mask, GATE_BIAS))
        tl.store(out_ptr + b * stride_ob + c * stride_oc + o_offsets, out.to(out_ptr.dtype.element_ty), mask=mask)
