"""The fused circulant attention (cat.ops.fused): its hand-written backward, stored or lean, in channel groups from a
memory budget, on every DFT backend; the packed spectrum; what it keeps for the backward."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F

from cat.ops import CirculantAttention, circulant_attention, fused, set_attention_memory, set_lean_attention
from cat.ops.fused import channel_groups, circulant_attention_function
from cat.ops.policy import AUTO_DEPTH
from cat.ops.spectral import pack_spectrum, unpack_spectrum
from tests.ops.test_circulant import dense_bccb_attention

GRIDS = [(1, 1), (1, 7), (2, 2), (3, 5), (4, 6), (7, 3), (6, 4), (5, 5), (8, 1)]


@pytest.mark.parametrize("hw", GRIDS)
def test_packed_spectrum_is_exact_and_has_n_reals(hw):
    H, W = hw
    x = torch.randn(2, 3, H, W, dtype=torch.float64)
    spectrum = torch.fft.rfft2(x)
    packed = pack_spectrum(spectrum, W)
    assert packed.shape == (2, 3, H, W)  # N reals per map, not 2 * H * (W // 2 + 1)
    torch.testing.assert_close(unpack_spectrum(packed, W), spectrum, rtol=0, atol=1e-12)
    # Packing acts per map, so a channel mix commutes with it: the qkv GEMM can run on packed rows.
    mix = torch.randn(5, 3, dtype=torch.float64)
    mixed = unpack_spectrum(torch.einsum("oc,bchw->bohw", mix, packed), W)
    torch.testing.assert_close(mixed, torch.fft.rfft2(torch.einsum("oc,bchw->bohw", mix, x)), rtol=0, atol=1e-12)
    # N reals determine the map: the packing of a random real array unpacks to a spectrum whose
    # inverse packs back to the same array (pack is a bijection of R^N).
    arbitrary = torch.randn(2, 3, H, W, dtype=torch.float64)
    roundtrip = pack_spectrum(torch.fft.rfft2(torch.fft.irfft2(unpack_spectrum(arbitrary, W), s=hw)), W)
    torch.testing.assert_close(roundtrip, arbitrary, rtol=0, atol=1e-12)


def autograd_module(
    attn: CirculantAttention, x: torch.Tensor, hw: tuple[int, int], operator=circulant_attention
) -> torch.Tensor:
    """The module's computation through autograd on a (q, k, v) operator: the functional FFT one
    (the pre-lean path) or the dense O(N^2) BCCB reference."""
    B, N, C = x.shape
    q, k, v = F.linear(x, attn.qkv.weight).view(B, *hw, 3 * C).chunk(3, dim=-1)
    y = operator(q, k, v, head_dim=attn.head_dim).reshape(B, N, C)
    if attn.gate is not None:
        y = y * attn.gate(x)
    return attn.proj(y)


CASES = [  # (B, hw, dim, head_dim, reweight)
    (2, (3, 4), 4, 1, "post"),
    (1, (5, 3), 6, 2, "post"),
    (2, (2, 5), 4, 4, "none"),
    (1, (4, 4), 3, 1, "none"),
    (1, (1, 6), 2, 1, "post"),
]


@pytest.fixture(params=["stored", "lean", "lean, groups of one head"])
def keeping(request, monkeypatch):
    """What the forward keeps: the spectra; or x alone, all channels in one group, or a group per head (a working
    set larger than any budget)."""
    if request.param.endswith("head"):
        monkeypatch.setattr(fused, "LEAN_WORKING_FLOATS", 2**62)
    return request.param


def test_channel_groups_come_from_the_budget_in_bytes():
    working = fused.LEAN_WORKING_FLOATS * 8 * 196 * 192 * 4  # a 224^2 batch of 8 of CA-DeiT-T, float32
    assert channel_groups(192, 1, 8 * 196, 4, working) == [(0, 192)]  # fits: one group, whatever the batch
    assert channel_groups(192, 1, 64 * 196, 4, 8 * working) == [(0, 192)]
    assert channel_groups(192, 1, 8 * 196, 4, working // 2) == [(0, 96), (96, 192)]
    assert channel_groups(12, 4, 10**6, 4, 1) == [(0, 4), (4, 8), (8, 12)]  # whole heads, however small
    assert all((hi - lo) % 4 == 0 for lo, hi in channel_groups(24, 4, 3 * 2**18, 4, 2**20))


BACKENDS = ["fft", "separable", "matmul"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packed", [False, True], ids=["half", "packed"])
@pytest.mark.parametrize("case", CASES)
def test_fused_backward_passes_gradcheck(case, packed, backend, keeping):
    B, hw, dim, head_dim, reweight = case
    torch.manual_seed(0)
    attn = CirculantAttention(dim, head_dim=head_dim, reweight=reweight).double()
    x = torch.randn(B, hw[0] * hw[1], dim, dtype=torch.float64, requires_grad=True)
    params = [attn.qkv.weight, attn.proj.weight, attn.proj.bias]
    if attn.gate is not None:
        params += [attn.gate[0].weight, attn.gate[0].bias]
    weight = torch.randn(B, hw[0] * hw[1], dim, dtype=torch.float64)  # a generic output gradient

    def fn(x, qkv_w, proj_w, proj_b, gate_w=None, gate_b=None):
        out, _ = circulant_attention_function(
            x, qkv_w, gate_w, gate_b, proj_w, proj_b, hw, head_dim, 0.7, backend, keeping != "stored", 2**30,
            packed=packed,
        )  # fmt: skip
        return (out * weight).sum()

    assert torch.autograd.gradcheck(fn, (x, *(p.detach().clone().requires_grad_() for p in params)))


@pytest.mark.parametrize("reference", [circulant_attention, dense_bccb_attention], ids=["functional", "dense"])
@pytest.mark.parametrize("packed", [False, True], ids=["half", "packed"])
@pytest.mark.parametrize("case", CASES)
def test_fused_module_equals_autograd_path_in_values_and_gradients(case, packed, keeping, reference):
    B, hw, dim, head_dim, reweight = case
    torch.manual_seed(1)
    lean = keeping != "stored"
    attn = CirculantAttention(dim, head_dim=head_dim, reweight=reweight, pack_spectrum=packed, lean=lean).double()
    x = torch.randn(B, hw[0] * hw[1], dim, dtype=torch.float64, requires_grad=True)
    g = torch.randn(B, hw[0] * hw[1], dim, dtype=torch.float64)
    params = [x, *attn.parameters()]
    fused_out = attn(x, hw)
    fused_grads = torch.autograd.grad((fused_out * g).sum(), params)
    ref_out = autograd_module(attn, x, hw, reference)
    ref_grads = torch.autograd.grad((ref_out * g).sum(), params)
    torch.testing.assert_close(fused_out, ref_out, rtol=1e-10, atol=1e-12)
    for got, ref in zip(fused_grads, ref_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-11)


def test_lean_backward_under_bf16_autocast_keeps_dtypes():
    torch.manual_seed(2)
    attn = CirculantAttention(16, lean=True)
    x = torch.randn(2, 35, 16, requires_grad=True)
    ref = attn(x, (5, 7))
    ref_grad = torch.autograd.grad(ref.sum(), x)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(x, (5, 7))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32
    assert (x.grad - ref_grad).norm() / ref_grad.norm() < 5e-2
    assert all(p.grad.dtype == torch.float32 for p in attn.parameters())


def saved_bytes(fn, leaves) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of ``fn()``, minus ``leaves``'."""
    held = {t.untyped_storage().data_ptr() for t in leaves}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in held:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_what_the_forward_keeps_stored_and_lean():
    """The budget of docs/perf.md. Lean: the gate's pre-activation (x is the caller's; the rest is recomputed).
    Stored: that and fused.stored_floats (the spectra of x and q, k, v, the weights, the output). Autograd through
    the plain operators keeps far more than either."""
    B, hw, dim = 2, (8, 8), 16
    x = torch.randn(B, 64, dim, requires_grad=True)
    attn = CirculantAttention(dim)
    unit = B * 64 * dim * 4
    leaves = [x, *attn.parameters()]
    kept = {}
    for lean in (True, False):
        attn.lean = lean
        kept[lean] = saved_bytes(lambda: attn(x, hw), leaves)
    plain = saved_bytes(lambda: autograd_module(attn, x, hw), leaves)
    assert kept[True] == unit
    assert kept[False] == unit + fused.stored_floats(B * 64, dim, dim, hw) * 4
    assert plain > kept[False] > 5 * kept[True]


@pytest.mark.slow  # torch.compile: seconds per case
@pytest.mark.parametrize("batch", [1, 2])  # at batch 1 a channel group's output is a contiguous slice, at 2 strided
def test_torch_compile_keeps_the_lean_memory_and_traces_inference(batch, monkeypatch):
    """Traced, the lean function's backward recomputation is merged with its forward (AOTAutograd's
    common-subexpression pass) and its intermediates are saved after all; so a compiled model calls it as it is in
    training: the same saved bytes and gradients as eagerly. Without autograd it is traced whole, groups and all."""
    monkeypatch.setattr(fused, "LEAN_WORKING_FLOATS", 256 // batch)  # 1.5 MiB: two groups within 1 MiB
    torch.manual_seed(6)
    model = timm.create_model("ca_deit_tiny", img_size=32, depth=1, num_classes=3).double()
    set_attention_memory(set_lean_attention(model, True), 1)
    assert len(channel_groups(192, 1, batch * 4, 8, 2**20)) == 2
    x = torch.randn(batch, 3, 32, 32, dtype=torch.float64, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    leaves = [x, *model.parameters()]
    assert saved_bytes(lambda: compiled(x), leaves) == saved_bytes(lambda: model(x), leaves)
    grads = [torch.autograd.grad(fn(x).square().sum(), x)[0] for fn in (model, compiled)]
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-12)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
        torch.testing.assert_close(out, model(x), rtol=1e-10, atol=1e-12)


def test_set_lean_attention_switches_to_stored_spectra_with_the_same_result():
    torch.manual_seed(3)
    model = torch.nn.ModuleList([CirculantAttention(8, lean=True), CirculantAttention(8, lean=True)]).double()
    x = torch.randn(2, 12, 8, dtype=torch.float64, requires_grad=True)
    run = lambda: model[1](model[0](x, (3, 4)), (3, 4))  # noqa: E731
    leaves = [x, *model.parameters()]
    lean_out, lean_saved = run(), saved_bytes(run, leaves)
    lean_grads = torch.autograd.grad(run().sum(), leaves)
    assert set_lean_attention(model, False) is model
    assert not any(m.lean for m in model)
    torch.testing.assert_close(run(), lean_out, rtol=0, atol=0)  # the same forward
    for got, ref in zip(torch.autograd.grad(run().sum(), leaves), lean_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)  # the same backward, from kept or recomputed spectra
    assert saved_bytes(run, leaves) > 5 * lean_saved


def test_auto_keeps_the_spectra_while_a_deep_model_would_fit_the_budget():
    """lean='auto' (the default): stored spectra while AUTO_DEPTH blocks' would fit the memory budget, past it the
    lean function; the outputs agree either way."""
    torch.manual_seed(4)
    attn = CirculantAttention(16).double()
    assert attn.lean == "auto" and attn.memory_mb is None
    x = torch.randn(2, 64, 16, dtype=torch.float64, requires_grad=True)
    leaves, run = [x, *attn.parameters()], lambda: attn(x, (8, 8))
    stored = fused.stored_floats(2 * 64, 16, 16, (8, 8)) * 8
    measured = {}
    for policy in (False, True, "auto"):
        attn.lean = policy
        measured[policy] = (run(), saved_bytes(run, leaves))
    for memory_mb, name in ((-(-stored * AUTO_DEPTH // 2**20), "fits"), ((stored * AUTO_DEPTH - 1) // 2**20, "past")):
        set_attention_memory(attn, memory_mb)
        measured[name] = (run(), saved_bytes(run, leaves))
    assert measured["auto"][1] == measured["fits"][1] == measured[False][1] > 5 * measured[True][1]
    assert measured["past"][1] == measured[True][1]
    for out, _ in measured.values():
        torch.testing.assert_close(out, measured[False][0], rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="positive number of MiB"):
        set_attention_memory(attn, 0)


@pytest.mark.parametrize("policy", ["maybe", 1, None])
def test_a_lean_policy_other_than_true_false_auto_is_refused(policy):
    with pytest.raises(ValueError, match="lean must be True, False or 'auto'"):
        CirculantAttention(8, lean=policy)
    with pytest.raises(ValueError, match="lean must be True, False or 'auto'"):
        set_lean_attention(torch.nn.Sequential(CirculantAttention(8)), policy)


@pytest.mark.parametrize("packed", [False, True], ids=["half", "packed"])
def test_lean_backward_with_a_qkv_bias_passes_gradcheck(packed):
    """A qkv bias (timm's qkv_bias=True models, converted): v's part added to the output; q's and k's, which
    shift every logit of a head alike, get zero gradient, as the finite differences confirm."""
    torch.manual_seed(5)
    B, hw, dim, head_dim = 2, (3, 4), 6, 2
    x = torch.randn(B, 12, dim, dtype=torch.float64, requires_grad=True)
    shapes = ((18, 6), (18,), (6, 6), (6,), (6, 6), (6,))
    params = [torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in shapes]
    weight = torch.randn(B, 12, dim, dtype=torch.float64)

    def fn(x, qkv_w, qkv_b, proj_w, proj_b, gate_w, gate_b):
        out, _ = circulant_attention_function(
            x, qkv_w, gate_w, gate_b, proj_w, proj_b, hw, head_dim, 0.7, lean=True, packed=packed, qkv_bias=qkv_b
        )
        return (out * weight).sum()

    assert torch.autograd.gradcheck(fn, (x, *params))


@pytest.mark.parametrize("gated", [True, False], ids=["gate", "no-gate"])
def test_lean_backward_with_prefix_tokens_passes_gradcheck(gated):
    """Tokens before the grid (a converted ViT's class and register tokens): their attention outputs come in as
    ``prefix`` and are gated and projected with the grid's; x's rows of them reach only the gate."""
    torch.manual_seed(6)
    B, hw, dim, head_dim, P = 2, (3, 4), 6, 2, 2
    T = P + hw[0] * hw[1]
    x = torch.randn(B, T, dim, dtype=torch.float64, requires_grad=True)
    params = [torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in ((18, 6), (18,), (6, 6), (6,))]
    gate = [torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in ((6, 6), (6,))] if gated else []
    prefix = torch.randn(B, P, dim, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(B, T, dim, dtype=torch.float64)

    def attention(x, qkv_w, qkv_b, proj_w, proj_b, gate_w=None, gate_b=None, prefix=None):
        return circulant_attention_function(
            x, qkv_w, gate_w, gate_b, proj_w, proj_b, hw, head_dim, 0.7, lean=True, qkv_bias=qkv_b, prefix=prefix
        )[0]

    def fn(x, qkv_w, qkv_b, proj_w, proj_b, prefix, *gate):
        return (attention(x, qkv_w, qkv_b, proj_w, proj_b, *gate, prefix=prefix) * weight).sum()

    assert torch.autograd.gradcheck(fn, (x, *params, prefix, *gate))
    out = attention(x, *params, *gate, prefix=prefix)
    grid = attention(x[:, P:], *params, *gate)
    gating = F.silu(F.linear(x[:, :P], *gate)) if gated else 1.0
    torch.testing.assert_close(out, torch.cat([F.linear(prefix * gating, *params[2:]), grid], dim=1))
