"""The hierarchical zoo: every model trains, dense features at any size, PVT/Swin checkpoint parity."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.models import model_entrypoint

import cat
from cat.layers import parse_attn_pattern
from cat.models import CheckpointMismatchError, load_backbone_checkpoint
from cat.models.convert import PluginCirculantAttention
from cat.ops import CirculantAttention, set_lean_attention
from tests.conftest import QUICK_MODELS, quick_few

OURS = sorted(n for n in timm.list_models() if model_entrypoint(n).__module__.startswith("cat."))
HIERARCHICAL = [n for n in OURS if not n.startswith("ca_deit")]


def test_registry_holds_the_zoo():
    expected = {f"{p}pvt_{s}" for p in ("", "ca_") for s in ("tiny", "small", "medium", "large")}
    expected |= {
        "ca_swin_tiny",
        "ca_swin_small",
        "ca_swin_base",
        "ca_swin_base_384",
        "cat_tiny",
        "cat_small",
        "cat_base",
        "ca_deit_tiny",
        "ca_deit_small",
        "ca_deit_base",
        "deit_small_reweight_patch16_224",  # Table 5's DeiT-S with token reweighting
    }
    assert set(OURS) == expected


@pytest.mark.parametrize("name", quick_few(OURS, QUICK_MODELS))
def test_forward_backward_small_resolution(name):
    """Every parameter of every model gets a gradient, with the parameter's strides: DDP's gradient buckets
    are views with those strides, and it warns on every run whose gradients differ, even in dimensions of size
    1 (the positional convs' weights did). The tiny variants compute for real; the wider ones share their code
    and are checked on the meta device (shapes and graph, no arithmetic)."""
    device = "cpu" if name.endswith("tiny") or name.startswith("deit_") else "meta"
    with torch.device(device):
        model = timm.create_model(name, num_classes=5, img_size=64).train()
        out = model(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 5)
    out.logsumexp(dim=1).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing[:5]
    strided = [(n, p.stride(), p.grad.stride()) for n, p in model.named_parameters() if p.grad.stride() != p.stride()]
    assert not strided, strided[:3]


@pytest.mark.parametrize("name", [n for n in OURS if n.startswith("ca") and n.endswith("tiny")])
def test_blocks_take_token_major_memory(name):
    """Every circulant block gets contiguous (B, N, C) tokens. A residual stream in another layout (a
    transposed view of a conv's NCHW output) stays so through every add, and each LayerNorm and linear layer
    copies it again, forward and backward: about 4 % of CA-DeiT-T's training step at 224^2 (docs/perf.md)."""
    model = timm.create_model(name, num_classes=5, img_size=64).train()
    layouts = []
    for block in model.modules():
        if isinstance(block, cat.layers.CirculantBlock):
            block.register_forward_pre_hook(lambda _m, args: layouts.append(args[0].is_contiguous()))
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    assert layouts and all(layouts), layouts


DENSE_CASES = [("cat_tiny", None)] + [
    (name, pattern) for name in ("pvt_tiny", "ca_pvt_tiny", "ca_swin_tiny") for pattern in (None, "SSSS", "CM1SS")
]


@pytest.mark.parametrize("name, pattern", DENSE_CASES)
def test_dense_features_any_size(name, pattern):
    kwargs = {} if pattern is None else {"attn_pattern": pattern}
    model = timm.create_model(name, features_only=True, **kwargs).eval()
    with torch.no_grad():
        feats = model(torch.randn(1, 3, 200, 328))
    assert model.feature_info.reduction() == [4, 8, 16, 32]
    for f, stride, ch in zip(feats, [4, 8, 16, 32], model.feature_info.channels(), strict=True):
        assert f.shape == (1, ch, -(-200 // stride), -(-328 // stride))


def test_dense_out_indices_and_norm():
    model = timm.create_model("ca_pvt_tiny", features_only=True, out_indices=(1, 3)).eval()
    feats = model(torch.randn(1, 3, 96, 160))
    assert [f.shape[1] for f in feats] == [128, 512]
    base = timm.create_model("cat_tiny").eval()
    x = torch.randn(1, 3, 64, 96)
    plain = base.forward_intermediates(x, intermediates_only=True)
    normed = base.forward_intermediates(x, norm=True, intermediates_only=True)
    torch.testing.assert_close(plain[0], normed[0])
    assert not torch.allclose(plain[3], normed[3])


def test_swin_ssss_is_timm_swin():
    reference = timm.create_model("swin_tiny_patch4_window7_224", num_classes=10).eval()
    ours = cat.create_model("ca_swin_tiny", attn_pattern="SSSS", num_classes=10, drop_path_rate=0.1).eval()
    report = cat.models.load_state_dict(ours, reference.state_dict(), strict=True)
    assert report.clean
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(x))


def test_pvt_ssss_uses_release_names():
    keys = set(timm.create_model("pvt_tiny").state_dict())
    expected = {"cls_token", "norm.weight", "norm.bias", "head.weight", "head.bias"}
    for s, sr in zip(range(1, 5), (8, 4, 2, 1), strict=True):
        expected |= {f"pos_embed{s}"} | {
            f"patch_embed{s}.{m}.{p}" for m in ("proj", "norm") for p in ("weight", "bias")
        }
        for j in range(2):
            layers = ["norm1", "attn.q", "attn.kv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"]
            layers += ["attn.sr", "attn.norm"] if sr > 1 else []
            expected |= {f"block{s}.{j}.{m}.{p}" for m in layers for p in ("weight", "bias")}
    assert keys == expected


def test_ca_pvt_keeps_position_embeddings_and_circulant_stages():
    model = timm.create_model("ca_pvt_tiny")
    names = set(model.state_dict())
    assert {"pos_embed1", "pos_embed2", "pos_embed3", "pos_embed4", "cls_token"} <= names
    assert "block1.0.attn.gate.0.weight" in names and "block2.1.cpe.weight" in names
    assert "block3.0.attn.sr.weight" in names and "block1.0.attn.sr.weight" not in names
    assert model.no_weight_decay() >= {"stages.0.pos_embed", "stages.3.cls_token"}
    params = dict(model.named_parameters())
    assert all(name in params for name in model.no_weight_decay())


def test_backbone_checkpoint_drops_head_and_resizes(tmp_path):
    source = timm.create_model("ca_pvt_tiny", num_classes=10)
    torch.save({"model": source.state_dict()}, tmp_path / "cls.pth")
    backbone = timm.create_model("ca_pvt_tiny", img_size=320, num_classes=0)
    report = load_backbone_checkpoint(backbone, tmp_path / "cls.pth")
    assert report.clean, str(report)
    assert backbone.stages[0].pos_embed.shape == (1, 80 * 80, 64)
    torch.testing.assert_close(backbone.stages[0].blocks[0].attn.qkv.weight, source.stages[0].blocks[0].attn.qkv.weight)

    swin = timm.create_model("ca_swin_tiny", num_classes=10)
    torch.save(swin.state_dict(), tmp_path / "swin.pth")
    swin_backbone = timm.create_model("ca_swin_tiny", num_classes=0)
    assert load_backbone_checkpoint(swin_backbone, tmp_path / "swin.pth").clean
    table = "layers.2.blocks.0.attn.relative_position_bias_table"
    torch.testing.assert_close(swin_backbone.state_dict()[table], swin.state_dict()[table])


def test_a_strict_backbone_takes_every_weight_from_its_checkpoint(tmp_path):
    """strict (det/seg's strict_load): another model's weights, or the same family at another size, are refused by
    name (non-strict, training would start from the initialisation where they do not fit, and PVT-S's would give
    PVT-T the first blocks of its stages); what the backbone pruned (the final norm) is no mismatch."""
    backbone = cat.create_model("ca_pvt_tiny", num_classes=0)
    whole = backbone.state_dict().keys()
    backbone.prune_intermediate_layers([0, 1, 2, 3], prune_norm=True, prune_head=True)
    pruned = whole - backbone.state_dict().keys()
    torch.save(cat.create_model("ca_pvt_tiny").state_dict(), tmp_path / "own.pth")
    assert load_backbone_checkpoint(backbone, tmp_path / "own.pth", strict=True, pruned=pruned).clean
    for other in ("ca_deit_tiny", "ca_pvt_small", "pvt_tiny"):
        torch.save(cat.create_model(other).state_dict(), tmp_path / f"{other}.pth")
        with pytest.raises(CheckpointMismatchError) as error:
            load_backbone_checkpoint(backbone, tmp_path / f"{other}.pth", strict=True, pruned=pruned)
        assert str(error.value).startswith(
            f"checkpoint {tmp_path / other}.pth does not match the model (a ca_pvt_tiny backbone takes every one of "
            "its weights from it; strict_load=false starts what does not fit from the initialisation):\n"
        ), other
        assert not load_backbone_checkpoint(backbone, tmp_path / f"{other}.pth").clean  # non-strict: a report

    # A Swin without its last stage: timm's Swin adapter looked up the pruned stage's modules (AttributeError).
    swin = cat.create_model("ca_swin_tiny", num_classes=0)
    whole = swin.state_dict().keys()
    swin.prune_intermediate_layers([0, 1, 2], prune_norm=True, prune_head=True)
    torch.save(cat.create_model("ca_swin_tiny").state_dict(), tmp_path / "swin.pth")
    assert load_backbone_checkpoint(
        swin, tmp_path / "swin.pth", strict=True, pruned=whole - swin.state_dict().keys()
    ).clean


CHECKPOINTED = [(n, lean) for n in ("ca_pvt_tiny", "ca_swin_tiny", "cat_tiny") for lean in (True, False)]


@pytest.mark.parametrize(
    ("name", "lean"), [*CHECKPOINTED, ("deit_tiny_patch16_224+convert", True), ("deit_tiny_patch16_224+convert", False)]
)
def test_grad_checkpointing_matches(name, lean):
    """Every family (and a converted timm ViT) under timm's set_grad_checkpointing: the circulant
    attention really runs again in the backward, on the lean function or on autograd's, and the
    gradients are the ones without checkpointing."""
    name, _, convert = name.partition("+")
    model = timm.create_model(name, num_classes=3, drop_path_rate=0.0, **({"img_size": 64} if convert else {}))
    if convert:
        cat.convert(model)
    set_lean_attention(model.train(), lean)
    attention = next(m for m in model.modules() if isinstance(m, (CirculantAttention, PluginCirculantAttention)))
    calls = []
    attention.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(1, 3, 64, 64)
    model(x).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    assert len(calls) == 3  # once without checkpointing, then forward and recomputation
    for n, g in grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[n].grad, g, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("pattern, counts", [("CCSS", [2, 2, 0, 0]), ("SSSS", [0, 0, 0, 0]), ("CM1SM2", [2, 1, 0, 2])])
def test_attn_pattern(pattern, counts):
    assert parse_attn_pattern(pattern, (2, 2, 6, 2)) == counts


@pytest.mark.parametrize("pattern", ["CCS", "CCSX", "CM9SS", "ccss"])
def test_attn_pattern_errors(pattern):
    with pytest.raises(ValueError, match="attn_pattern"):
        parse_attn_pattern(pattern, (2, 2, 6, 2))


@pytest.mark.parametrize(("size", "window", "shift"), [((14, 14), (7, 7), (3, 3)), ((24, 36), (12, 12), (6, 6))])
def test_shifted_window_mask_is_timms(size, window, shift):
    """CA-Swin's traceable mask equals the one timm's Swin block computes by slice assignment."""
    from timm.models.swin_transformer import SwinTransformerBlock

    from cat.models.swin import shifted_window_mask

    block = SwinTransformerBlock(8, size, num_heads=2, window_size=window, shift_size=shift, dynamic_mask=True)
    x = torch.zeros(1, *size, 8)
    torch.testing.assert_close(shifted_window_mask(x, window, shift), block.get_attn_mask(x), rtol=0, atol=0)
