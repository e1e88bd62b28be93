"""CA-DeiT: released parameter counts, any resolution, the timm model API."""

from __future__ import annotations

import hashlib

import pytest
import timm
import torch

import cat
from cat.errors import CheckpointError
from tests.hostile import write_hostile_files

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


def test_features_only_gives_stride_16_maps_of_the_last_blocks():
    model = small(features_only=True, out_indices=(0, 1)).eval()
    maps = model(torch.randn(2, 3, 48, 80))
    assert [m.shape for m in maps] == [(2, 32, 3, 5)] * 2
    assert model.feature_info.reduction() == [16, 16]


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


FIXTURE_ARGS = {"embed_dim": 64, "depth": 2, "patch_size": 8, "img_size": 64, "num_classes": 10}


def fixture_logits(official_ca_deit, model):
    io = torch.load(official_ca_deit / "small_p8_64.io.pth", weights_only=True)
    with torch.no_grad():
        return model.eval()(io["input"]), io["logits"]


def test_pretrained_config_points_at_the_release():
    for name in ("ca_deit_tiny", "ca_deit_small", "ca_deit_base"):
        cfg = timm.models.get_pretrained_cfg(name)
        assert cfg.custom_load and cfg.url[0].startswith("https://cloud.tsinghua.edu.cn/f/")
        assert cfg.url[1] == f"{name}_release.pth"
    assert set(timm.list_pretrained("ca_deit_*")) == {"ca_deit_tiny", "ca_deit_small", "ca_deit_base"}


def test_pretrained_file_overlay_gives_the_release_logits(official_ca_deit):
    overlay = {"file": str(official_ca_deit / "small_p8_64.pth")}
    model = timm.create_model("ca_deit_tiny", pretrained=True, pretrained_cfg_overlay=overlay, **FIXTURE_ARGS)
    torch.testing.assert_close(*fixture_logits(official_ca_deit, model), rtol=1e-5, atol=1e-5)
    # Another class count: everything but the classifier loads.
    other = timm.create_model(
        "ca_deit_tiny", pretrained=True, pretrained_cfg_overlay=overlay, **{**FIXTURE_ARGS, "num_classes": 3}
    )
    torch.testing.assert_close(other.blocks[1].attn.qkv.weight, model.blocks[1].attn.qkv.weight)


def test_pretrained_url_downloads_into_timms_cache_and_checks_the_hash(official_ca_deit, tmp_path, monkeypatch):
    release = official_ca_deit / "small_p8_64.pth"
    digest = hashlib.sha256(release.read_bytes()).hexdigest()
    # TORCH_HOME, not torch.hub.set_dir: set_dir pins the cache for the rest of the process.
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    url = (release.as_uri(), f"ca_deit_fixture-{digest[:10]}.pth")
    model = timm.create_model("ca_deit_tiny", pretrained=True, pretrained_cfg_overlay={"url": url}, **FIXTURE_ARGS)
    torch.testing.assert_close(*fixture_logits(official_ca_deit, model), rtol=1e-5, atol=1e-5)
    assert (tmp_path / "torch" / "hub" / "checkpoints" / url[1]).is_file()
    wrong = (release.as_uri(), "ca_deit_fixture-0123abcd.pth")
    with pytest.raises(CheckpointError, match="fails its hash check.*0123abcd"):
        timm.create_model("ca_deit_tiny", pretrained=True, pretrained_cfg_overlay={"url": wrong}, **FIXTURE_ARGS)


def test_pretrained_download_failure_says_how_to_load_offline(tmp_path, monkeypatch):
    """timm's download fails before cat's loader sees a file (offline, a dead link): the error names the URL
    and the offline route, where timm's was a bare URLError."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    absent = ((tmp_path / "absent.pth").as_uri(), "ca_deit_absent.pth")  # no network: a file:// URL that fails
    expected = r"absent\.pth.*the authors' release is https://cloud\.tsinghua.*pretrained_cfg_overlay=dict\(file="
    with pytest.raises(CheckpointError, match=expected):
        timm.create_model("ca_deit_tiny", pretrained=True, pretrained_cfg_overlay={"url": absent})


def test_pretrained_refuses_corrupt_and_hostile_files(official_ca_deit, tmp_path):
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes((official_ca_deit / "small_p8_64.pth").read_bytes()[:100_000])
    with pytest.raises(CheckpointError, match="truncated.pth is unreadable"):
        timm.create_model("ca_deit_tiny", pretrained=True, pretrained_cfg_overlay={"file": str(truncated)})
    marker = tmp_path / "MARKER"
    hostile = write_hostile_files(tmp_path / "hostile", marker)["yacs_config_payload"]
    with pytest.raises(CheckpointError, match="refusing to load"):
        timm.create_model("ca_deit_tiny", pretrained=True, pretrained_cfg_overlay={"file": str(hostile)})
    assert not marker.exists()
