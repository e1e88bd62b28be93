"""torch.hub: the checkout's hubconf.py offers every model cat registers, built as cat.create_model builds it."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import cat
from cat.errors import CheckpointError
from cat.models import cat_model_names
from tests.conftest import REPO


def test_every_registered_model_is_a_hub_entry_point():
    spec = importlib.util.spec_from_file_location("hubconf_under_test", REPO / "hubconf.py")
    hub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hub)
    # What torch.hub lists: the module's public callables.
    entries = sorted(name for name in dir(hub) if callable(getattr(hub, name)) and not name.startswith("_"))
    assert entries == sorted(cat_model_names()) and "ca_deit_tiny" in entries and "ca_swin_tiny" in entries
    assert all(importlib.util.find_spec(package) for package in hub.dependencies)


def test_torch_hub_load_local_builds_the_model_and_passes_its_arguments():
    torch.manual_seed(0)
    model = torch.hub.load(str(REPO), "ca_deit_tiny", source="local", num_classes=10, embed_dim=32, depth=2)
    torch.manual_seed(0)
    same = cat.create_model("ca_deit_tiny", num_classes=10, embed_dim=32, depth=2)
    assert type(model) is type(same) and model.num_classes == 10
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values(), strict=True))


def test_pretrained_offline_says_what_timm_create_model_says(tmp_path, monkeypatch):
    """pretrained=True goes through timm's pretrained path: offline (here a file:// URL that fails; no network),
    the one-line error naming the release and the local route."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    absent = ((tmp_path / "absent.pth").as_uri(), "ca_deit_absent.pth")
    with pytest.raises(CheckpointError, match=r"absent\.pth.*the authors' release is https://cloud\.tsinghua"):
        torch.hub.load(
            str(REPO), "ca_deit_tiny", source="local", pretrained=True, pretrained_cfg_overlay={"url": absent}
        )


def test_pretrained_from_a_local_release_file_gives_its_logits(official_ca_deit):
    overlay = {"file": str(official_ca_deit / "small_p8_64.pth")}
    args = {"embed_dim": 64, "depth": 2, "patch_size": 8, "img_size": 64, "num_classes": 10}
    model = torch.hub.load(
        str(REPO), "ca_deit_tiny", source="local", pretrained=True, pretrained_cfg_overlay=overlay, **args
    )
    io = torch.load(official_ca_deit / "small_p8_64.io.pth", weights_only=True)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(io["input"]), io["logits"], rtol=1e-5, atol=1e-5)
