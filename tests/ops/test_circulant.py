"""The fast FFT operator equals dense BCCB attention, in values and gradients, at any grid shape."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cat.ops import CirculantAttention, bccb_project, circulant_attention
from cat.ops.reference import released_circulant_attention


def dense_bccb_attention(q, k, v, head_dim=1, scale=None):
    """O(N^2) reference: build the N x N BCCB attention matrix explicitly, then multiply."""
    B, H, W, C = q.shape
    N, heads = H * W, C // head_dim
    if scale is None:
        scale = 1.0 / math.sqrt(N * head_dim)
    to_heads = lambda t: t.reshape(B, N, heads, head_dim).transpose(1, 2)  # noqa: E731
    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
    scores = qh @ kh.transpose(-1, -2)  # (B, heads, N, N)
    # logits[d] = scale * sum_i <q_i, k_{i+d}> = scale * N * (BCCB projection of QK^T).
    logits = scale * N * bccb_project(scores, (H, W))
    attn = logits.softmax(dim=-1)
    return (attn @ vh).transpose(1, 2).reshape(B, H, W, C)


def loop_bccb_project(a, hw):
    """Literal definition: average of the entries sharing each torus offset."""
    H, W = hw
    N = H * W
    out = torch.empty_like(a)
    sums, counts = {}, {}
    coords = [(i // W, i % W) for i in range(N)]
    for i, (yi, xi) in enumerate(coords):
        for j, (yj, xj) in enumerate(coords):
            d = ((yj - yi) % H, (xj - xi) % W)
            sums[d] = sums.get(d, 0) + a[i, j]
            counts[d] = counts.get(d, 0) + 1
    for i, (yi, xi) in enumerate(coords):
        for j, (yj, xj) in enumerate(coords):
            d = ((yj - yi) % H, (xj - xi) % W)
            out[i, j] = sums[d] / counts[d]
    return out


SHAPES = [  # (B, H, W, C, head_dim)
    (2, 3, 5, 2, 1),
    (1, 4, 6, 4, 2),
    (2, 7, 3, 6, 3),
    (1, 5, 5, 8, 8),
    (1, 1, 7, 3, 1),
    (1, 6, 4, 6, 1),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_fast_equals_dense_bccb(shape):
    B, H, W, C, d = shape
    q, k, v = torch.randn(3, B, H, W, C, dtype=torch.float64).unbind(0)
    torch.testing.assert_close(
        circulant_attention(q, k, v, head_dim=d), dense_bccb_attention(q, k, v, d), rtol=1e-10, atol=1e-12
    )


def test_scale_is_respected():
    q, k, v = torch.randn(3, 2, 4, 6, 4, dtype=torch.float64).unbind(0)
    paper_scale = 1.0 / (24 * math.sqrt(2))  # 1 / (N sqrt(d))
    torch.testing.assert_close(
        circulant_attention(q, k, v, head_dim=2, scale=paper_scale),
        dense_bccb_attention(q, k, v, 2, scale=paper_scale),
        rtol=1e-10,
        atol=1e-12,
    )
    assert not torch.allclose(
        circulant_attention(q, k, v, head_dim=2, scale=paper_scale), circulant_attention(q, k, v, head_dim=2)
    )


@pytest.mark.parametrize("shape", [(1, 3, 4, 2, 1), (2, 2, 3, 4, 2)])
def test_gradients_match_reference(shape):
    B, H, W, C, d = shape
    q, k, v = (torch.randn(B, H, W, C, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda *t: circulant_attention(*t, head_dim=d), (q, k, v))
    g = torch.randn(B, H, W, C, dtype=torch.float64)
    fast = torch.autograd.grad((circulant_attention(q, k, v, head_dim=d) * g).sum(), (q, k, v))
    ref = torch.autograd.grad((dense_bccb_attention(q, k, v, d) * g).sum(), (q, k, v))
    for a, b in zip(fast, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_attention_map_is_bccb_and_translation_equivariant():
    q, k, v = torch.randn(3, 1, 5, 6, 4, dtype=torch.float64).unbind(0)
    out = circulant_attention(q, k, v)
    rolled = circulant_attention(*(t.roll((2, 3), dims=(1, 2)) for t in (q, k, v)))
    torch.testing.assert_close(rolled, out.roll((2, 3), dims=(1, 2)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_cpu_low_precision(dtype):
    q, k, v = torch.randn(3, 2, 7, 9, 8).unbind(0)  # non-power-of-two grid
    ref = circulant_attention(q, k, v, head_dim=2)
    with torch.autocast("cpu", dtype=dtype):
        out = circulant_attention(q.to(dtype), k.to(dtype), v.to(dtype), head_dim=2)
    assert out.dtype == dtype
    assert (out.float() - ref).norm() / ref.norm() < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_cuda_low_precision(dtype):
    q, k, v = torch.randn(3, 2, 14, 14, 16, device="cuda").unbind(0)
    ref = circulant_attention(q, k, v)
    with torch.autocast("cuda", dtype=dtype):
        out = circulant_attention(q.to(dtype), k.to(dtype), v.to(dtype))
    assert out.dtype == dtype
    assert (out.float() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize(
    "bad, match",
    [
        ((torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.randn(2, 3, 4)), "shaped"),
        ((torch.randn(1, 3, 4, 2), torch.randn(1, 3, 5, 2), torch.randn(1, 3, 4, 2)), "same shape"),
    ],
)
def test_bad_shapes_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        circulant_attention(*bad)


def test_bad_head_dim_raises():
    q = torch.randn(1, 3, 4, 6)
    with pytest.raises(ValueError, match="head_dim"):
        circulant_attention(q, q, q, head_dim=4)


# --- the module: released CA-DeiT numerics -----------------------------------------------------


@pytest.mark.parametrize("hw", [(4, 4), (3, 5), (6, 7)])
def test_module_matches_released_pipeline(hw):
    attn = CirculantAttention(8).double()
    x = torch.randn(2, hw[0] * hw[1], 8, dtype=torch.float64)
    torch.testing.assert_close(attn(x, hw), released_circulant_attention(attn, x, hw), rtol=1e-10, atol=1e-12)


def test_module_keeps_weights_on_request():
    attn = CirculantAttention(6, head_dim=2).double()
    x = torch.randn(2, 12, 6, dtype=torch.float64)
    attn(x, (3, 4))
    assert attn.last_weights is None
    attn.keep_weights = True
    attn(x, (3, 4))
    w = attn.last_weights
    assert w.shape == (2, 3, 3, 4)
    torch.testing.assert_close(w.sum(dim=(-1, -2)), torch.ones(2, 3, dtype=torch.float64))


def test_module_parameter_names():
    names = {n for n, _ in CirculantAttention(8).named_parameters()}
    assert names == {"qkv.weight", "gate.0.weight", "gate.0.bias", "proj.weight", "proj.bias"}
    assert "gate.0.weight" not in dict(CirculantAttention(8, reweight="none").named_parameters())


@pytest.mark.parametrize("reweight", ["post", "pre", "none"])
@pytest.mark.parametrize("head_dim", [1, 4])
def test_module_reweight_variants_equal_functional(reweight, head_dim):
    dim, hw = 8, (3, 4)
    attn = CirculantAttention(dim, head_dim=head_dim, reweight=reweight).double()
    x = torch.randn(2, 12, dim, dtype=torch.float64)
    q, k, v = F.linear(x, attn.qkv.weight).view(2, 3, 4, 3 * dim).chunk(3, dim=-1)
    t = attn.gate(x).view(2, 3, 4, dim) if attn.gate is not None else 1.0
    if reweight == "pre":
        y = circulant_attention(q, k, v * t, head_dim=head_dim)
    else:
        y = circulant_attention(q, k, v, head_dim=head_dim) * t
    expected = attn.proj(y.reshape(2, 12, dim))
    torch.testing.assert_close(attn(x, hw), expected, rtol=1e-10, atol=1e-12)


def test_module_autocast_bf16_cpu():
    attn = CirculantAttention(16)
    x = torch.randn(2, 35, 16)
    ref = attn(x, (5, 7))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(x, (5, 7))
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).norm() / ref.norm() < 3e-2


def test_module_rejects_wrong_grid():
    attn = CirculantAttention(8)
    with pytest.raises(ValueError, match="tokens"):
        attn(torch.randn(1, 12, 8), (3, 5))
    with pytest.raises(ValueError, match=r"\(B, N, 8\)"):
        attn(torch.randn(1, 12, 6), (3, 4))


# --- the BCCB projection -----------------------------------------------------------------------


@pytest.mark.parametrize("hw", [(2, 3), (3, 3), (4, 2)])
def test_bccb_project_matches_definition(hw):
    a = torch.randn(hw[0] * hw[1], hw[0] * hw[1], dtype=torch.float64)
    torch.testing.assert_close(bccb_project(a, hw), loop_bccb_project(a, hw))


def test_bccb_project_is_an_orthogonal_projection():
    hw, N = (3, 5), 15
    a = torch.randn(4, N, N, dtype=torch.float64)
    p = bccb_project(a, hw)
    torch.testing.assert_close(bccb_project(p, hw), p)  # idempotent
    b = bccb_project(torch.randn(N, N, dtype=torch.float64), hw)  # an arbitrary BCCB matrix
    torch.testing.assert_close(bccb_project(b, hw), b)  # fixes BCCB matrices
    inner = ((a - p) * b).sum(dim=(-1, -2))  # residual orthogonal to the BCCB subspace
    torch.testing.assert_close(inner, torch.zeros(4, dtype=torch.float64), atol=1e-10, rtol=0)


def test_bccb_project_rejects_wrong_size():
    with pytest.raises(ValueError, match="bccb_project"):
        bccb_project(torch.randn(10, 10), (3, 4))


def test_bccb_stochastic_matrix_is_closer_than_random():
    hw, N = (4, 5), 20
    logits = bccb_project(torch.randn(N, N, dtype=torch.float64), hw)
    bccb_stochastic = logits.softmax(dim=-1)  # rows of a BCCB matrix are permutations of one another
    random_stochastic = torch.rand(N, N, dtype=torch.float64)
    random_stochastic /= random_stochastic.sum(-1, keepdim=True)
    distance = lambda a: ((a - bccb_project(a, hw)).norm() / a.norm()).item()  # noqa: E731
    assert distance(bccb_stochastic) < 1e-12 < 0.1 < distance(random_stochastic)


# --- the matmul DFT backend ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_matmul_backend_equals_fft_backend(shape):
    B, H, W, C, d = shape
    q, k, v = (torch.randn(B, H, W, C, dtype=torch.float64, requires_grad=True) for _ in range(3))
    fft = circulant_attention(q, k, v, head_dim=d, fft_backend="fft")
    mm = circulant_attention(q, k, v, head_dim=d, fft_backend="matmul")
    torch.testing.assert_close(mm, fft, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(fft)
    for a, b in zip(
        torch.autograd.grad((fft * g).sum(), (q, k, v)), torch.autograd.grad((mm * g).sum(), (q, k, v)), strict=True
    ):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reweight", ["post", "pre"])
@pytest.mark.parametrize("hw", [(14, 14), (7, 10)])
def test_matmul_backend_module_float32(reweight, hw):
    attn = CirculantAttention(24, head_dim=2, reweight=reweight)
    x = torch.randn(2, hw[0] * hw[1], 24)
    ref = attn(x, hw)
    attn.fft_backend = "matmul"
    torch.testing.assert_close(attn(x, hw), ref, rtol=1e-5, atol=1e-5)


def test_set_fft_backend_and_validation():
    from cat.ops import set_fft_backend

    model = torch.nn.Sequential(CirculantAttention(4), CirculantAttention(4))
    set_fft_backend(model, "matmul")
    assert {m.fft_backend for m in model} == {"matmul"}
    with pytest.raises(ValueError, match="fft_backend"):
        set_fft_backend(model, "cufft")
    with pytest.raises(ValueError, match="fft_backend"):
        CirculantAttention(4, fft_backend="dft")


def test_matmul_backend_after_inference_mode_still_trains():
    attn = CirculantAttention(8, fft_backend="matmul")
    x = torch.randn(1, 30, 8)
    with torch.inference_mode():
        attn(x, (5, 6))  # builds and caches the DFT matrices for this grid
    attn(x.requires_grad_(), (5, 6)).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_matmul_backend_after_export_still_computes():
    """torch.export traces the matmul backend with fake tensors: the DFT matrices it makes belong to that
    trace, and eager calls afterwards must still get real ones (a cached fake matrix makes every output fake)."""
    from cat.ops import dft

    attn = CirculantAttention(8, fft_backend="matmul").eval()
    x = torch.randn(2, 7 * 9, 8)

    class Grid(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = attn

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.attn(tokens, (7, 9))

    dft._constants.clear()  # the export is the grid's first call
    program = torch.export.export(Grid(), (x,)).module()
    after = attn(x, (7, 9))
    assert type(after) is torch.Tensor
    attn.fft_backend = "fft"
    expected = attn(x, (7, 9))
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(program(x), expected, rtol=1e-5, atol=1e-5)
