"""Checkpoint loading: formats, strictness, and refusal to run pickled code."""

from __future__ import annotations

import pickle

import pytest
import torch

import cat
from cat.models import CheckpointMismatchError, load_checkpoint_file

KWARGS = dict(embed_dim=32, depth=1, num_classes=5, img_size=32)


def build():
    return cat.create_model("ca_deit_tiny", **KWARGS)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda sd: {"model": sd, "optimizer": {}, "epoch": 3},  # release / cat format
        lambda sd: sd,  # bare state dict
        lambda sd: {"state_dict": {"module." + k: v for k, v in sd.items()}},  # mmengine + DDP prefix
    ],
)
def test_formats_round_trip(tmp_path, wrap):
    src = build()
    path = tmp_path / "ckpt.pth"
    torch.save(wrap(src.state_dict()), path)
    dst = cat.create_model("ca_deit_tiny", checkpoint=path, **KWARGS)
    for k, v in src.state_dict().items():
        torch.testing.assert_close(dst.state_dict()[k], v)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda model, ema: {"model": model, "model_ema": ema},  # cat's and DeiT's
        lambda model, ema: {"state_dict": model, "state_dict_ema": ema},  # timm's train.py
        lambda model, ema: {"model": model, "ema": {"module." + k: v for k, v in ema.items()}},  # cat's earlier
    ],
)
def test_a_weight_ema_loads_on_request(tmp_path, wrap):
    """A checkpoint's weight EMA, under each name it goes by, loads with use_ema; without it, the model's weights,
    which is cat's choice (timm's own loader prefers the EMA, and reads cat's name for it: a foreign check)."""
    from timm.models import load_checkpoint as timm_load_checkpoint

    model, ema = build().state_dict(), build().state_dict()
    path = tmp_path / "ckpt.pth"
    torch.save(wrap(model, ema), path)
    for use_ema, expected in ((False, model), (True, ema)):
        loaded = cat.create_model("ca_deit_tiny", checkpoint=path, use_ema=use_ema, **KWARGS).state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in expected.items()), use_ema
    if "ema" not in wrap(model, ema):  # timm knows the two names, not cat's earlier one
        by_timm = build()
        timm_load_checkpoint(by_timm, str(path))
        assert all(torch.equal(by_timm.state_dict()[k], v) for k, v in ema.items())


def test_a_missing_weight_ema_is_named(tmp_path):
    path = tmp_path / "plain.pth"
    torch.save({"model": build().state_dict(), "model_ema": None}, path)  # a run without EMA
    with pytest.raises(cat.errors.CheckpointError, match=r"plain\.pth holds no weight EMA \(no model_ema, "):
        cat.create_model("ca_deit_tiny", checkpoint=path, use_ema=True, **KWARGS)


def test_mismatch_lists_keys_and_shapes(tmp_path):
    sd = build().state_dict()
    sd.pop("norm.weight")
    sd["extra.weight"] = torch.zeros(1)
    sd["head.weight"] = torch.zeros(9, 32)
    path = tmp_path / "bad.pth"
    torch.save({"model": sd}, path)
    with pytest.raises(CheckpointMismatchError) as err:
        cat.create_model("ca_deit_tiny", checkpoint=path, **KWARGS)
    msg = str(err.value)
    assert "norm.weight" in msg and "extra.weight" in msg and "head.weight" in msg and "(9, 32)" in msg
    model = build()
    report = cat.load_checkpoint(model, path, strict=False)
    assert report.missing == ["norm.weight"] and report.unexpected == ["extra.weight"]
    torch.testing.assert_close(model.patch_embed.proj.weight, sd["patch_embed.proj.weight"])


@pytest.mark.parametrize("writer", ["legacy", "safetensors"])
def test_other_weight_formats_load(tmp_path, writer):
    """torch's pre-1.6 format, and safetensors (timm's weights on the Hugging Face hub), through the one
    loader: a timm model and a circulant one."""
    from safetensors.torch import save_file

    for name, kwargs in (("deit_tiny_patch16_224", dict(KWARGS, embed_dim=48)), ("ca_deit_tiny", KWARGS)):
        src = cat.create_model(name, **kwargs)
        path = tmp_path / f"{name}.{writer}"
        if writer == "safetensors":
            save_file(src.state_dict(), path)
        else:
            torch.save(src.state_dict(), path, _use_new_zipfile_serialization=False)
        dst = cat.create_model(name, checkpoint=path, **kwargs)
        for k, v in src.state_dict().items():
            torch.testing.assert_close(dst.state_dict()[k], v)


def test_missing_empty_and_corrupt_files_are_named(tmp_path):
    from safetensors.torch import save_file

    from cat.errors import CheckpointError

    with pytest.raises(CheckpointError, match="nope.pth"):
        load_checkpoint_file(tmp_path / "nope.pth")
    good = tmp_path / "good.pth"
    torch.save({"model": build().state_dict()}, good)
    save_file(build().state_dict(), tmp_path / "good.safetensors")
    broken = {
        "empty.pth": b"",
        "random.pth": bytes(range(256)) * 40,
        "truncated.pth": good.read_bytes()[:2000],
        "truncated.safetensors": (tmp_path / "good.safetensors").read_bytes()[:2000],
        "notes.pth": b'{"epoch": 3}',
        "page.pth": b"\n<!DOCTYPE html>\n<html><head><title>Sign in</title></head></html>",
    }
    for name, data in broken.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(CheckpointError, match=name) as error:
            load_checkpoint_file(tmp_path / name)
        # torch's weights-only reader advises weights_only=False; for a broken file that is no advice to pass on
        assert "weights_only" not in str(error.value)
    assert "a web page, saved in place of the file" in str(error.value)


def test_release_format_with_yacs_config(official_ca_deit):
    ckpt = load_checkpoint_file(official_ca_deit / "small_p8_64.pth")
    assert set(ckpt) >= {"model", "optimizer", "lr_scheduler", "epoch", "max_accuracy", "config"}
    assert ckpt["config"]["DATA"]["IMG_SIZE"] == 64
    with pytest.raises(pickle.UnpicklingError):  # the weights-only loader alone cannot read it
        torch.load(official_ca_deit / "small_p8_64.pth", weights_only=True)
