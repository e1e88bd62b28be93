"""CA-DeiT: released parameter counts, any resolution, the timm model API."""

from __future__ import annotations

import pytest
import timm
import torch

import cat

# Parameter counts of the released CA-DeiT models at 1000 classes.
RELEASED_PARAMS = {"ca_deit_tiny": 6_140_200, "ca_deit_small": 23_780_968, "ca_deit_base": 93_567_208}


@pytest.mark.parametrize("name", sorted(RELEASED_PARAMS))
def test_parameter_counts_match_release(name):
    with torch.device("meta"):
        model = timm.create_model(name)
    assert sum(p.numel() for p in model.parameters()) == RELEASED_PARAMS[name]


def small(**kwargs):
    return timm.create_model("ca_deit_tiny", embed_dim=32, depth=2, num_classes=7, **kwargs)


@pytest.mark.parametrize("size", [(64, 64), (48, 96), (112, 32)])
def test_any_resolution_divisible_by_patch(size):
    model = small().eval()
    x = torch.randn(2, 3, *size)
    feats = model.forward_features(x)
    assert feats.shape == (2, (size[0] // 16) * (size[1] // 16), 32)
    assert model.forward_head(feats, pre_logits=True).shape == (2, 32)
    assert model(x).shape == (2, 7)


def test_indivisible_resolution_is_a_clear_error():
    with pytest.raises(ValueError, match="divisible by 16"):
        small()(torch.randn(1, 3, 60, 64))


def test_forward_backward_and_grad_checkpointing_agree():
    model = small(drop_path_rate=0.0).train()
    x = torch.randn(2, 3, 32, 48)
    model(x).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).square().sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6, msg=n)


def test_timm_api():
    model = small()
    assert model.no_weight_decay() == set()
    assert model.get_classifier().out_features == 7
    model.reset_classifier(0)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 32)
    cfg = timm.data.resolve_data_config({}, model=timm.create_model("ca_deit_small"))
    assert cfg["interpolation"] == "bicubic" and cfg["crop_pct"] == 0.875


def test_features_only_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="isotropic"):
        timm.create_model("ca_deit_tiny", features_only=True)


def test_unknown_model_names_close_matches():
    with pytest.raises(ValueError, match="unknown model 'ca_deit_tinyy'.*ca_deit_tiny"):
        cat.create_model("ca_deit_tinyy")


def test_official_checkpoint_logits(official_ca_deit):
    model = cat.create_model(
        "ca_deit_tiny",
        checkpoint=official_ca_deit / "small_p8_64.pth",
        embed_dim=64,
        depth=2,
        patch_size=8,
        img_size=64,
        num_classes=10,
    ).eval()
    io = torch.load(official_ca_deit / "small_p8_64.io.pth", weights_only=True)
    with torch.no_grad():
        logits = model(io["input"])
    torch.testing.assert_close(logits, io["logits"], rtol=1e-5, atol=1e-5)
