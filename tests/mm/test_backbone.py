"""The models page's table of backbone feature levels is what the models report (timm's ``feature_info``, built on the
meta device), so a neck written from it fits without running code."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO

TABLE_HEAD = "| backbone (`model.backbone.name`, `TimmBackbone(model_name=)`) |"


def _readme_rows() -> list[tuple[list[str], list[int], list[int]]]:
    """(model names, channels, strides) of each row of the models page's table."""
    text = (REPO / "docs" / "models.md").read_text()
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
def test_the_tabled_feature_levels_are_the_models(names, channels, strides):
    from cat.mm.backbone import backbone_features

    for name in names:
        levels = backbone_features(name)
        got_channels, got_strides = [level["num_chs"] for level in levels], [level["reduction"] for level in levels]
        if len(channels) == 1:  # a plain ViT: one level per block, all alike
            assert set(got_channels) == set(channels) and set(got_strides) == set(strides), name
        else:  # a pyramid: one level per stage, in order
            assert (got_channels, got_strides) == (channels, strides), name


def test_the_table_covers_every_model_cat_registers_and_every_preset_backbone():
    from cat.models import cat_model_names

    covered = {name for names, _, _ in ROWS for name in names}
    used = set()
    for config in [
        *(REPO / "configs" / "det" / "model").glob("*.yaml"),
        *(REPO / "configs" / "seg" / "model").glob("*.yaml"),
    ]:
        used.update(re.findall(r"^\s+name: (\w+)$", config.read_text(), re.M))
    assert used and used <= covered, used - covered
    assert set(cat_model_names()) <= covered, set(cat_model_names()) - covered


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


def _detector_checkpoint(path, backbone) -> None:
    """What mmengine saves for a detector whose backbone is ``backbone``: its weights under ``backbone.``, beside a
    neck's and heads' (as an ``epoch_N.pth`` of train_det.py holds them)."""
    import torch

    state = {f"backbone.{k}": v for k, v in backbone.state_dict().items()}
    state |= {"neck.lateral_convs.0.conv.weight": torch.zeros(4, 4, 1, 1), "rpn_head.rpn_cls.bias": torch.zeros(3)}
    torch.save({"meta": {"epoch": 1}, "state_dict": state}, path)


def test_a_detectors_checkpoint_as_backbone_weights_is_refused_naming_its_prefix(tmp_path):
    """A detector's epoch_1.pth given as a CA-Swin backbone's ImageNet weights (pretrained=, or init_cfg without a
    prefix) ends in one line naming the file, what it holds and prefix='backbone.', before the first iteration (the
    check train_det.py makes); with that prefix the backbone's weights load from it as mmengine loads any backbone."""
    import torch

    from cat.errors import CheckpointError
    from cat.mm.backbone import check_pretrained, register_backbones

    mmdet_registry = pytest.importorskip("mmdet.registry", reason="OpenMMLab stack not installed")
    register_backbones()
    torch.manual_seed(0)
    source = mmdet_registry.MODELS.build({"type": "TimmBackbone", "model_name": "ca_swin_tiny"})
    checkpoint = tmp_path / "epoch_1.pth"
    _detector_checkpoint(checkpoint, source)
    for config in (
        {"pretrained": str(checkpoint)},
        {"init_cfg": {"type": "Pretrained", "checkpoint": str(checkpoint)}},
        {"pretrained": str(checkpoint), "strict_pretrained": True},
    ):
        backbone = mmdet_registry.MODELS.build({"type": "TimmBackbone", "model_name": "ca_swin_tiny", **config})
        for load in (check_pretrained, lambda model: model.init_weights()):
            with pytest.raises(CheckpointError) as refused:
                load(backbone)
            line = str(refused.value)
            assert "\n" not in line and line.startswith(f"{checkpoint} holds a detector's or segmentor's weights")
            assert "beside neck, rpn_head" in line and "prefix='backbone.'" in line
    prefixed = {"type": "Pretrained", "checkpoint": str(checkpoint), "prefix": "backbone."}
    backbone = mmdet_registry.MODELS.build({"type": "TimmBackbone", "model_name": "ca_swin_tiny", "init_cfg": prefixed})
    backbone.init_weights()
    for key, value in source.state_dict().items():
        assert torch.equal(backbone.state_dict()[key], value), key


def test_a_url_as_backbone_weights_is_fetched_as_mmengine_does_and_read_safely(tmp_path, monkeypatch):
    """``init_cfg=dict(type='Pretrained', checkpoint='http://...')``, a stock user's URL: downloaded (here from a
    server on the loopback) into torch's hub cache, read by the safe loader, and the log says how many of the
    backbone's tensors it gave. A pickle that would run code, served the same way, is refused."""
    import functools
    import http.server
    import logging
    import threading

    import torch
    from mmengine.logging import MMLogger

    import cat
    from cat.mm.backbone import check_pretrained, register_backbones
    from cat.models import UnsafeCheckpointError
    from tests.hostile import write_hostile_files

    mmdet_registry = pytest.importorskip("mmdet.registry", reason="OpenMMLab stack not installed")
    register_backbones()
    served = tmp_path / "served"
    served.mkdir()
    torch.manual_seed(0)
    weights = cat.create_model("ca_pvt_tiny", num_classes=10).state_dict()
    torch.save({"model": weights}, served / "ca_pvt_t_in1k.pth")
    write_hostile_files(served, tmp_path / "ran")  # zip_torch.pth among them: torch.save of a reducer
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    logged: list[logging.LogRecord] = []
    collector = logging.Handler()
    collector.emit = logged.append  # type: ignore[method-assign]
    MMLogger.get_current_instance().addHandler(collector)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        config = {"type": "Pretrained", "checkpoint": f"{url}/ca_pvt_t_in1k.pth"}
        backbone = mmdet_registry.MODELS.build(
            {"type": "TimmBackbone", "model_name": "ca_pvt_tiny", "init_cfg": config}
        )
        check_pretrained(backbone)
        backbone.init_weights()
        evil = mmdet_registry.MODELS.build(
            {"type": "TimmBackbone", "model_name": "ca_pvt_tiny", "pretrained": f"{url}/zip_torch.pth"}
        )
        with pytest.raises(UnsafeCheckpointError):
            check_pretrained(evil)
    finally:
        server.shutdown()
        MMLogger.get_current_instance().removeHandler(collector)
    assert (tmp_path / "hub" / "checkpoints" / "ca_pvt_t_in1k.pth").is_file() and not (tmp_path / "ran").exists()
    for key, value in backbone.model.state_dict().items():
        assert torch.equal(value, weights[key]), key
    total = len(backbone.model.state_dict())
    line = f"loaded {total}/{total} of its tensors from {url}/ca_pvt_t_in1k.pth (0 missing there"
    assert any(line in record.getMessage() for record in logged), [r.getMessage()[:200] for r in logged[-3:]]
