"""cat.convert: timm's ViT/DeiT/EVA, Swin and PVT v2 with circulant attention, still timm models."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

import cat
from cat.models.convert import GATE_IDENTITY_BIAS, PluginCirculantAttention
from cat.ops import circulant_attention, set_lean_attention
from tests.ops.test_lean import saved_bytes

# Small widths and depths keep the CPU tests fast; the conversion sees the same block types.
SOURCES = {
    "deit_tiny_patch16_224": {"img_size": (64, 96), "depth": 2},
    "swin_tiny_patch4_window7_224": {"img_size": (64, 96), "depths": (2, 2, 2, 2), "window_size": 4},
    "pvt_v2_b0": {},
    "eva02_tiny_patch14_224": {"img_size": (56, 84), "depth": 2},
    "vit_small_patch16_rope_224": {"img_size": (64, 96), "depth": 2},  # EVA with timm's AttentionRope
}
NON_SQUARE = {"deit_tiny_patch16_224": (64, 96), "swin_tiny_patch4_window7_224": (64, 96), "pvt_v2_b0": (64, 96)}
NON_SQUARE["eva02_tiny_patch14_224"] = (56, 84)
NON_SQUARE["vit_small_patch16_rope_224"] = (64, 96)


def source(name: str, **kwargs) -> nn.Module:
    return timm.create_model(name, **{"num_classes": 5, **SOURCES[name], **kwargs})


def test_gate_starts_at_one():
    assert torch.nn.functional.silu(torch.tensor(GATE_IDENTITY_BIAS, dtype=torch.float64)).item() == pytest.approx(1.0)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_converted_model_trains_at_a_non_square_input(name):
    model = source(name)
    params_before = sum(p.numel() for p in model.parameters())
    cat.convert(model)
    assert model.circulant_blocks
    plugins = [m for m in model.modules() if isinstance(m, PluginCirculantAttention)]
    assert len(plugins) == len(model.circulant_blocks)
    added = sum(p.numel() for m in plugins for p in m.gate.parameters())
    print(f"{name}: {params_before} -> {sum(p.numel() for p in model.parameters())} parameters ({added} gate)")
    x = torch.randn(2, 3, *NON_SQUARE[name])
    out = model.train()(x)
    assert out.shape == (2, 5)
    out.logsumexp(1).sum().backward()
    assert all(p.grad is not None for m in plugins for p in m.parameters())


@pytest.mark.parametrize("reg_tokens", [0, 4])
@pytest.mark.parametrize("lean", [False, True])
def test_vit_conversion_reuses_weights_and_matches_the_definition(reg_tokens, lean):
    model = source("deit_tiny_patch16_224", reg_tokens=reg_tokens).eval()
    qkv, proj = model.blocks[1].attn.qkv, model.blocks[1].attn.proj
    cat.convert(model, blocks="blocks.1")
    assert model.circulant_blocks == ["blocks.1"]
    assert not isinstance(model.blocks[0].attn, PluginCirculantAttention)
    attn = set_lean_attention(model, lean).blocks[1].attn
    P = 1 + reg_tokens
    assert attn.qkv is qkv and attn.proj is proj and attn.num_prefix_tokens == P
    torch.nn.init.normal_(qkv.bias, std=0.5)  # timm starts it at zero, where a lost bias would not show
    # The grid tokens: circulant attention of the block's own q, k, v (gate = 1), then its projection.
    tokens = torch.randn(2, P + 4 * 6, 192)
    attn.grid = (4, 6)
    q, k, v = (t[:, P:].reshape(2, 4, 6, 192) for t in qkv(tokens).chunk(3, dim=-1))
    expected = proj(circulant_attention(q, k, v).reshape(2, 24, 192))
    # Class and register tokens: the source's softmax attention over every token (3 heads), then its projection.
    q, k, v = (t.unflatten(-1, (3, 64)).transpose(1, 2) for t in qkv(tokens).chunk(3, dim=-1))
    expected_prefix = proj(F.scaled_dot_product_attention(q[:, :, :P], k, v).transpose(1, 2).reshape(2, P, 192))
    with torch.no_grad():
        out = attn(tokens)
        torch.testing.assert_close(out[:, P:], expected)
        torch.testing.assert_close(out[:, :P], expected_prefix)
    with pytest.raises(ValueError, match="do not fit the grid"):
        attn(torch.randn(2, 20, 192))


def _source_qkv(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """q, k, v side by side as the source attention computes them (EVA: its own q and v biases)."""
    if attn.qkv is None:
        return torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1)
    if getattr(attn, "q_bias", None) is not None:
        return F.linear(x, attn.qkv.weight, torch.cat([attn.q_bias, torch.zeros_like(attn.q_bias), attn.v_bias]))
    return attn.qkv(x)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", ["eva02_tiny_patch14_224", "vit_small_patch16_rope_224"])
def test_eva_attentions_keep_their_projections(name, fused):
    """EVA's two attentions (EvaAttention; AttentionRope, the ROPE ViTs'), fused or with q, k, v projections
    apart: the converted attention's q, k, v and output projection are the source's."""
    model = source(name, qkv_fused=fused)
    attn = model.blocks[0].attn
    for p in attn.parameters():  # biases too, which timm starts at zero
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 7, model.embed_dim)
    with torch.no_grad():
        expected = _source_qkv(attn, x)
        plugin = cat.convert(model).blocks[0].attn
        torch.testing.assert_close(plugin.qkv(x), expected)
    assert plugin.proj is attn.proj and plugin.num_prefix_tokens == model.num_prefix_tokens


def test_attentions_circulant_attention_cannot_stand_for_are_refused():
    """Grouped-query attention (keys and values narrower than queries), AttentionRope's sigmoid output gate and
    attention narrower than the tokens are named; a ViT whose blocks have no single attention (timm's parallel
    blocks) converts nothing."""
    from timm.layers.attention import AttentionRope

    with pytest.raises(ValueError, match=r"grouped-query attention \(num_kv_heads=2 of 6\)"):
        cat.convert(source("vit_small_patch16_rope_224", qkv_fused=False, num_kv_heads=2))
    gated = source("vit_small_patch16_rope_224")
    gated.blocks[0].attn = AttentionRope(384, num_heads=6, gated=True)
    with pytest.raises(ValueError, match=r"output gate \(gated=True\)"):
        cat.convert(gated)
    narrow = source("vit_small_patch16_rope_224")
    narrow.blocks[0].attn = AttentionRope(384, num_heads=6, attn_head_dim=32)
    with pytest.raises(ValueError, match="AttentionRope attends in 192 channels of 384-channel tokens"):
        cat.convert(narrow)
    with pytest.raises(ValueError, match="nothing converted in VisionTransformer"):
        cat.convert(timm.create_model("vit_small_patch16_18x2_224", depth=1))


def test_swin_and_pvt_stage_choice():
    swin = cat.convert(source("swin_tiny_patch4_window7_224"), stages=[1])
    assert swin.circulant_blocks == ["layers.1.blocks.0", "layers.1.blocks.1"]
    pvt = cat.convert(source("pvt_v2_b0"))  # the paper's CCSS
    assert {n.split(".")[1] for n in pvt.circulant_blocks} == {"0", "1"}
    assert pvt.stages[2].blocks[0].attn.sr is not None  # stage 3 keeps spatial-reduction attention
    with pytest.raises(ValueError, match="nothing converted"):
        cat.convert(source("pvt_v2_b0"), blocks="no.such.*")


@pytest.mark.parametrize("name", ["deit_tiny_patch16_224", "pvt_v2_b0", "swin_tiny_patch4_window7_224"])
def test_save_load_and_features_only(name, tmp_path):
    model = cat.convert(source(name)).eval()
    torch.save(model.state_dict(), tmp_path / "converted.pth")
    again = cat.convert(source(name)).eval()
    report = cat.load_checkpoint(again, tmp_path / "converted.pth")
    assert report.clean
    x = torch.randn(1, 3, *NON_SQUARE[name])
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))
    shallow = {"out_indices": (0, 1)} if name.startswith("deit") else {}  # of its two blocks
    features = cat.convert(source(name, features_only=True, **shallow)).eval()
    with torch.no_grad():
        maps = features(x)
    channels = [m.shape[-1 if name.startswith("swin") else 1] for m in maps]  # timm's Swin maps are NHWC
    assert channels == features.feature_info.channels()
    assert all(m.dim() == 4 for m in maps)


@pytest.mark.parametrize(
    "name", ["deit_tiny_patch16_224", "pvt_v2_b0", "eva02_tiny_patch14_224", "vit_small_patch16_rope_224"]
)
def test_converted_attention_on_the_lean_function_equals_the_plain_ops(name):
    """qkv biases (all three sources) in the frequency domain, the class token (DeiT, EVA) beside the
    grid: values and gradients as the plain ops give them, in float64, and far less kept for the
    backward."""
    torch.manual_seed(0)
    model = cat.convert(source(name)).double().train()
    for m in model.modules():  # a gate that is not the identity, so its gradient path is checked too
        if isinstance(m, PluginCirculantAttention):
            torch.nn.init.normal_(m.gate[0].weight, std=0.02)
            if m.qkv.bias is not None:  # timm starts it at zero
                torch.nn.init.normal_(m.qkv.bias, std=0.5)
    x = torch.randn(2, 3, *NON_SQUARE[name], dtype=torch.float64)
    results = {}
    for lean in (False, True):
        set_lean_attention(model, lean)
        model.zero_grad(set_to_none=True)
        out = model(x)
        out.logsumexp(1).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[lean] = (out.detach(), grads, saved_bytes(lambda: model(x).sum(), [x, *model.parameters()]))
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-10, atol=1e-12)
    assert results[True][1].keys() == results[False][1].keys()
    for n, g in results[False][1].items():
        torch.testing.assert_close(results[True][1][n], g, rtol=1e-8, atol=1e-10, msg=n)
    assert results[True][2] < results[False][2]


def test_converted_lean_path_trains_under_bf16_autocast():
    """The class token's attention enters the lean function as its ``prefix``: under bf16 autocast the step runs,
    the gradients stay float32 and close to float32's."""
    torch.manual_seed(1)
    model = set_lean_attention(cat.convert(source("deit_tiny_patch16_224")).train(), True)
    x = torch.randn(2, 3, *NON_SQUARE["deit_tiny_patch16_224"])
    grads = {}
    for amp in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = model(x)
        assert out.dtype == (torch.bfloat16 if amp else torch.float32)
        out.float().logsumexp(1).sum().backward()
        grads[amp] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert grads[True].dtype == torch.float32
    assert (grads[True] - grads[False]).norm() / grads[False].norm() < 5e-2  # 0.006 when written


@pytest.mark.parametrize("lean", [False, True])
def test_kept_weights_are_the_grids_kernels_whatever_the_qk_bias(lean):
    """``keep_weights`` (visualize_kernels reads it) keeps the grid's weights: those of the native layer with the
    same qkv weight on the grid alone. The q and k biases, which shift every logit of a head alike, leave them."""
    torch.manual_seed(0)
    B, C, hw = 2, 8, (3, 4)
    native = cat.ops.CirculantAttention(C, lean=lean)
    qkv = nn.Linear(C, 3 * C)
    nn.init.normal_(qkv.bias, std=0.5)
    qkv.weight.data.copy_(native.qkv.weight)
    plugin = PluginCirculantAttention(qkv, nn.Linear(C, C), num_heads=2, num_prefix_tokens=1, lean=lean)
    x = torch.randn(B, 1 + hw[0] * hw[1], C)
    assert plugin.last_weights is None
    native.keep_weights = plugin.keep_weights = True
    native(x[:, 1:], hw), plugin(x, hw)
    assert plugin.last_weights.shape == (B, C, *hw)
    torch.testing.assert_close(plugin.last_weights, native.last_weights)
    torch.testing.assert_close(plugin.last_weights.sum(dim=(-2, -1)), torch.ones(B, C))


def test_converted_attention_follows_the_fft_backend():
    """set_fft_backend switches cat.convert's attention too (it stayed on torch.fft, so a converted PVT v2 could not
    be exported without DFT ops): the matmul DFTs give the same outputs, class token or not."""
    torch.manual_seed(0)
    for name, kwargs in (("pvt_v2_b0", {}), ("deit_tiny_patch16_224", {"img_size": 64, "depth": 2})):
        model = cat.convert(timm.create_model(name, **kwargs)).eval()
        x = torch.randn(2, 3, 64, 64)
        with torch.no_grad():
            expected = model(x)
            cat.ops.set_fft_backend(model, "matmul")
            assert {m.fft_backend for m in model.modules() if isinstance(m, PluginCirculantAttention)} == {"matmul"}
            torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-5)
