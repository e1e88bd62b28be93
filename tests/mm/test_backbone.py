"""The README's table of backbone feature levels is what the models report (timm's ``feature_info``, built on the
meta device), so a neck written from it fits without running code."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO

TABLE_HEAD = "| backbone (`model.backbone.name`, `TimmBackbone(model_name=)`) |"


def _readme_rows() -> list[tuple[list[str], list[int], list[int]]]:
    """(model names, channels, strides) of each row of the README's table."""
    text = (REPO / "README.md").read_text()
    lines = text[text.index(TABLE_HEAD) :].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        names, _, channels, strides = (cell.strip() for cell in line.strip("|").split("|"))
        rows.append(
            (
                re.findall(r"`(\w+)`", names),
                [int(n) for n in re.findall(r"\d+", channels)],
                [int(n) for n in re.findall(r"\d+", strides)],
            )
        )
    return rows


ROWS = _readme_rows()


@pytest.mark.parametrize(("names", "channels", "strides"), ROWS, ids=[row[0][0] for row in ROWS])
def test_the_readmes_feature_levels_are_the_models(names, channels, strides):
    from cat.mm.backbone import backbone_features

    for name in names:
        levels = backbone_features(name)
        got_channels, got_strides = [level["num_chs"] for level in levels], [level["reduction"] for level in levels]
        if len(channels) == 1:  # a plain ViT: one level per block, all alike
            assert set(got_channels) == set(channels) and set(got_strides) == set(strides), name
        else:  # a pyramid: one level per stage, in order
            assert (got_channels, got_strides) == (channels, strides), name


def test_the_table_covers_every_dense_backbone_the_presets_use():
    covered = {name for names, _, _ in ROWS for name in names}
    used = set()
    for config in [
        *(REPO / "configs" / "det" / "model").glob("*.yaml"),
        *(REPO / "configs" / "seg" / "model").glob("*.yaml"),
    ]:
        used.update(re.findall(r"^\s+name: (\w+)$", config.read_text(), re.M))
    assert used and used <= covered, used - covered


def test_the_usual_pretrained_init_cfg_loads_what_pretrained_does(tmp_path):
    """``init_cfg=dict(type='Pretrained', checkpoint=...)``, OpenMMLab's idiom, built through mmdet's registry as a
    stock config does: the ImageNet weights load as with ``pretrained=`` (it loaded nothing before, the keys
    sitting under ``model.``, and only warned); given both ways at once, one line says to give it once."""
    import torch

    import cat
    from cat.mm.backbone import register_backbones

    mmdet_registry = pytest.importorskip("mmdet.registry", reason="OpenMMLab stack not installed")
    register_backbones()
    torch.manual_seed(0)
    checkpoint = tmp_path / "ca_pvt_t_imagenet.pth"
    torch.save({"model": cat.create_model("ca_pvt_tiny", num_classes=10).state_dict()}, checkpoint)
    built = {}
    for way, config in {
        "pretrained": {"pretrained": str(checkpoint)},
        "init_cfg": {"init_cfg": {"type": "Pretrained", "checkpoint": str(checkpoint)}},
        "neither": {},
    }.items():
        backbone = mmdet_registry.MODELS.build({"type": "TimmBackbone", "model_name": "ca_pvt_tiny", **config})
        backbone.init_weights()
        built[way] = backbone.model.state_dict()
    for key, value in built["pretrained"].items():
        assert torch.equal(built["init_cfg"][key], value), key
    assert any(not torch.equal(built["neither"][key], value) for key, value in built["pretrained"].items())
    with pytest.raises(ValueError, match="give the ImageNet checkpoint once, as pretrained=... or as init_cfg"):
        mmdet_registry.MODELS.build(
            {
                "type": "TimmBackbone",
                "model_name": "ca_pvt_tiny",
                "pretrained": str(checkpoint),
                "init_cfg": {"type": "Pretrained", "checkpoint": str(checkpoint)},
            }
        )
