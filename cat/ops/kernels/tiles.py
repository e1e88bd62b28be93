"""The 2-D DFT of one H x W map as GEMMs on a tile held on chip: what both circulant-attention kernels are made of.

A program holds a map as one BH x BW tile (BH, BW: H, W rounded up to a power of two, at least 16, the smallest
GEMM tile), zero outside the map. The DFT matrices are built in registers from their indices for each transform
(a few sines and cosines per entry, against the transform's 2 (BH + BW) multiply-adds: cheaper than keeping four
more tiles live across the kernel), never read from memory: C[k, m] = cos(2 pi k m / n) and
S[k, m] = sin(2 pi k m / n), zero outside n x n, both symmetric. Then for a
real map x, whose full spectrum X = F_H x F_W^T with F = C - iS:

    P = x C_W,  R = x S_W                  (two GEMMs along W)
    Re X = C_H P - S_H R,  Im X = -(S_H P + C_H R)     (four along H)

and the real map z of a Hermitian spectrum Z (the inverse, 1/(H W), as ``torch.fft.ifft2`` and real):

    T1 = Zr C_W - Zi S_W,  T2 = Zr S_W + Zi C_W,   z = (C_H T1 - S_H T2) / (H W)

six GEMMs each way, on the tensor cores in TF32 (or exact float32 FMAs: ``PRECISION``). The zero padding stays zero
through both: the matrices' padded rows and columns are zero.

These are plain functions: :mod:`cat.ops.kernels.launch` makes them ``triton.jit`` helpers for a GPU, or runs them
as they are under Triton's interpreter on a CPU.
"""

from __future__ import annotations

import triton.language as tl

TWO_PI = tl.constexpr(6.283185307179586)  # a global a jit function may read


def dft_matrices(n, B: tl.constexpr):
    """(C, S): the n-point DFT's cosine and sine matrices as B x B float32 tiles, zero outside n x n."""
    index = tl.arange(0, B)
    k = index[:, None]
    m = index[None, :]
    # The product reduced modulo n before scaling: the phase is exact for any grid the tile holds.
    phase = ((k * m) % n).to(tl.float32) * (TWO_PI / n)
    inside = (k < n) & (m < n)
    return tl.where(inside, tl.cos(phase), 0.0), tl.where(inside, tl.sin(phase), 0.0)


def forward_dft(x, H, W, BH: tl.constexpr, BW: tl.constexpr, PRECISION: tl.constexpr):
    """The full spectrum (Re, Im) of the real tile ``x`` of an H x W map."""
    ch, sh = dft_matrices(H, BH)
    cw, sw = dft_matrices(W, BW)
    p = tl.dot(x, cw, input_precision=PRECISION)
    r = tl.dot(x, sw, input_precision=PRECISION)
    re = tl.dot(ch, p, input_precision=PRECISION) - tl.dot(sh, r, input_precision=PRECISION)
    im = -(tl.dot(sh, p, input_precision=PRECISION) + tl.dot(ch, r, input_precision=PRECISION))
    return re, im


def inverse_dft(zr, zi, H, W, BH: tl.constexpr, BW: tl.constexpr, factor, PRECISION: tl.constexpr):
    """The real tile of an H x W map whose spectrum is the Hermitian (zr, zi), times ``factor`` (1 / (H W) for the
    inverse)."""
    ch, sh = dft_matrices(H, BH)
    cw, sw = dft_matrices(W, BW)
    t1 = tl.dot(zr, cw, input_precision=PRECISION) - tl.dot(zi, sw, input_precision=PRECISION)
    t2 = tl.dot(zr, sw, input_precision=PRECISION) + tl.dot(zi, cw, input_precision=PRECISION)
    return (tl.dot(ch, t1, input_precision=PRECISION) - tl.dot(sh, t2, input_precision=PRECISION)) * factor


def map_offsets(H, W, BH: tl.constexpr, BW: tl.constexpr, stride_n):
    """The offsets of a BH x BW tile's tokens (row-major on the grid, ``stride_n`` apart) and the mask of the map."""
    i = tl.arange(0, BH)[:, None]
    j = tl.arange(0, BW)[None, :]
    return (i * W + j) * stride_n, (i < H) & (j < W)


def head_logits(
    base,
    stride_c,
    first,
    C,
    mask,
    H,
    W,
    BH: tl.constexpr,
    BW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    scale,
    PRECISION: tl.constexpr,
):
    """The logits (a BH x BW tile) of one head: scale * IDFT(sum over its channels of conj(DFT q_c) DFT k_c), q_c at
    channel ``first + c`` of ``base`` and k_c ``C`` channels further, ``stride_c`` apart."""
    lr = tl.full((BH, BW), 0.0, tl.float32)
    li = tl.full((BH, BW), 0.0, tl.float32)
    for c in range(first, first + HEAD_DIM):
        q = tl.load(base + c * stride_c, mask=mask, other=0.0).to(tl.float32)
        k = tl.load(base + (C + c) * stride_c, mask=mask, other=0.0).to(tl.float32)
        qr, qi = forward_dft(q, H, W, BH, BW, PRECISION)
        kr, ki = forward_dft(k, H, W, BH, BW, PRECISION)
        lr += qr * kr + qi * ki
        li += qr * ki - qi * kr
    return inverse_dft(lr, li, H, W, BH, BW, 1.0 / (H * W), PRECISION) * scale


def tile_sum(x):
    """The sum of a 2-D tile. (tl.reduce with Triton's own combining functions, which are tl.sum's and tl.max's:
    those two are jit functions that the interpreter runs only in a process started with TRITON_INTERPRET=1.)"""
    return tl.reduce(tl.reduce(x, 1, tl.standard._sum_combine), 0, tl.standard._sum_combine)


def tile_max(x):
    """The largest entry of a 2-D tile (as :func:`tile_sum`)."""
    return tl.reduce(tl.reduce(x, 1, tl.standard._elementwise_max), 0, tl.standard._elementwise_max)


def gate_of(pointer, bias_pointer, mask, GATE_BIAS: tl.constexpr):
    """A channel's gate pre-activation (float32) read at ``pointer`` (the map's offsets added), its bias added."""
    a = tl.load(pointer, mask=mask, other=0.0).to(tl.float32)
    if GATE_BIAS:
        a += tl.load(bias_pointer).to(tl.float32)
    return a


def silu(a):
    """SiLU of a float32 tile: the gate's activation, a sigmoid(a)."""
    return a / (1.0 + tl.exp(-a))


def silu_derivative(a):
    """d SiLU(a) / da = s (1 + a (1 - s)), s = sigmoid(a)."""
    s = 1.0 / (1.0 + tl.exp(-a))
    return s * (1.0 + a * (1.0 - s))


def softmax_of(logits, mask):
    """The softmax over the map's entries of a tile of logits, and its log-sum-exp (what the backward recomputes
    the weights from)."""
    logits = tl.where(mask, logits, float("-inf"))
    top = tile_max(logits)
    e = tl.where(mask, tl.exp(logits - top), 0.0)
    total = tile_sum(e)
    return e / total, top + tl.log(total)
