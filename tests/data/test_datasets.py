"""The dataset builders: tensor sets, the ImageNet folder layout and its errors."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from PIL import Image

from cat.data import build_dataset
from cat.errors import ConfigError, DataError
from tests.conftest import compose_config


def test_tensor_sets():
    digits = build_dataset(compose_config("cls").data, None, "train")
    image, label = digits[0]
    assert image.shape == (3, 32, 32) and 0 <= int(label) < 10
    data = compose_config("cls", "data=synthetic", "data.samples_per_class=3").data
    assert len(build_dataset(data, None, "val")) == 3 * data.num_classes


def test_image_folder_and_its_errors(tmp_path):
    cfg = compose_config("cls", "data=folder", f"data.root={tmp_path}", "data.img_size=32", "aug=none")
    with pytest.raises(DataError, match="dataset split folder not found"):
        build_dataset(cfg.data, cfg.aug, "train")
    (tmp_path / "train").mkdir()
    for i in range(2):  # ImageNet's val as its archive unpacks: the images with no class folders
        Image.new("RGB", (40, 30)).save(tmp_path / "train" / f"ILSVRC2012_val_{i:08d}.JPEG")
    with pytest.raises(DataError, match=r"no class folders in .*train \(it holds 2 images directly, as ImageNet"):
        build_dataset(cfg.data, cfg.aug, "train")
    (tmp_path / "train" / "cat").mkdir()
    with pytest.raises(DataError, match="holds no images"):
        build_dataset(cfg.data, cfg.aug, "train")
    Image.new("RGB", (40, 30), (200, 10, 10)).save(tmp_path / "train" / "cat" / "a.jpg")
    dataset = build_dataset(cfg.data, cfg.aug, "train")
    image, label = dataset[0]
    assert image.shape == (3, 32, 32) and label == 0 and dataset.classes == ["cat"]
    with pytest.raises(ConfigError, match="split must be"):
        build_dataset(cfg.data, cfg.aug, "test")
    with pytest.raises(ConfigError, match="unknown dataset"):
        build_dataset(OmegaConf.merge(cfg.data, {"name": "mnist"}), cfg.aug, "train")


def test_val_folders_must_be_the_train_classes(tmp_path):
    """Labels are indices into each split's sorted class folders: a class missing from val shifts
    every later label, which only a comparison with train can catch."""
    cfg = compose_config("cls", "data=folder", f"data.root={tmp_path}", "data.img_size=32", "aug=none")
    for split, classes in (("train", ["ant", "bee", "cat"]), ("val", ["bee", "cat"])):
        for name in classes:
            (tmp_path / split / name).mkdir(parents=True)
            Image.new("RGB", (40, 30)).save(tmp_path / split / name / "a.jpg")
    with pytest.raises(DataError, match=r"val and .*train hold different class folders .* not in val: ant; not in"):
        build_dataset(cfg.data, cfg.aug, "val")
    (tmp_path / "val" / "ant").mkdir()
    Image.new("RGB", (40, 30)).save(tmp_path / "val" / "ant" / "a.jpg")
    assert build_dataset(cfg.data, cfg.aug, "val").class_to_idx == {"ant": 0, "bee": 1, "cat": 2}
    # Without a train split (an evaluation), the val folders are the classes.
    (tmp_path / "train").rename(tmp_path / "elsewhere")
    assert len(build_dataset(cfg.data, cfg.aug, "val").classes) == 3


def test_each_format_is_one_entry_that_the_schema_the_checks_and_the_reader_follow(tmp_path, monkeypatch):
    """data.format's choices and doc, the layout a missing root is told, the cache rule and the reader a split is
    built with all come from cat.data.registry.FORMATS: a format added there is read, named and checked."""
    from dataclasses import fields, replace

    from cat.data import FORMATS, DataConfig, data_root_problem, dataset_problems, registry

    declared = next(f for f in fields(DataConfig) if f.name == "format").metadata["check"]
    assert declared.choices == tuple(FORMATS) and all(spec.doc in declared.doc for spec in FORMATS.values())
    read = []
    npz = replace(
        FORMATS["folder"],
        read=lambda data, aug, request: read.append((data.format, request.split, request.rank)) or [],
        layout="{train}.npz and {val}.npz arrays",
        caches=True,
    )
    monkeypatch.setitem(registry.FORMATS, "npz", npz)
    cfg = compose_config("cls", "data=folder", f"data.root={tmp_path}", "aug=none")
    data = OmegaConf.merge(cfg.data, {"format": "npz", "cache_mode": "part"})
    assert build_dataset(data, cfg.aug, "val", rank=1, world=2) == [] and read == [("npz", "val", 1)]
    assert dataset_problems(data) == []  # it caches: cache_mode is its key too
    missing = OmegaConf.merge(data, {"root": str(tmp_path / "absent")})
    assert data_root_problem(missing).endswith("needs train.npz and val.npz arrays)")
    assert dataset_problems(OmegaConf.merge(data, {"format": "tar"})) == [
        "data.cache_mode=part: caches a zip or npz (data.format=zip or npz), not a tar"
    ]
