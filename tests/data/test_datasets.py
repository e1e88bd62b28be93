"""The dataset builders: tensor sets, the ImageNet folder layout and its errors. Each gets the typed sections a run
gives it (tests.conftest.typed_cls)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from PIL import Image

from cat.data import build_dataset
from cat.errors import ConfigError, DataError
from tests.conftest import typed_cls


def test_tensor_sets():
    cfg = typed_cls()
    image, label = build_dataset(cfg.data, cfg.aug, "train")[0]
    assert image.shape == (3, 32, 32) and 0 <= int(label) < 10
    cfg = typed_cls("data=synthetic", "data.samples_per_class=3")
    assert len(build_dataset(cfg.data, cfg.aug, "val")) == 3 * cfg.data.num_classes


def test_image_folder_and_its_errors(tmp_path):
    cfg = typed_cls("data=folder", f"data.root={tmp_path}", "data.img_size=32", "aug=none")
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
    with pytest.raises(ConfigError, match=r"data=folder needs data.root=/path/to/dataset"):
        build_dataset(replace(cfg.data, root=None), cfg.aug, "train")


def test_val_folders_must_be_the_train_classes(tmp_path):
    """Labels are indices into each split's sorted class folders: a class missing from val shifts
    every later label, which only a comparison with train can catch."""
    cfg = typed_cls("data=folder", f"data.root={tmp_path}", "data.img_size=32", "aug=none")
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
    """data.format's choices are the FormatName Literal (the type checker holds the code to them), each with one
    FORMATS entry and one reader; the key's doc, --help's choices, the layout a missing root is told, the cache rule
    and the reader a split is built with all come from those: a format added there is read, named and checked."""
    from typing import get_args

    from cat.classification.schema import ClsConfig
    from cat.data import FORMATS, data_root_problem, dataset_problems, registry
    from cat.data import build as builders
    from cat.runtime.schema import schema_keys

    assert get_args(registry.FormatName) == tuple(FORMATS) == tuple(builders.FORMAT_READERS)
    assert get_args(registry.DatasetName) == tuple(registry.DATASETS) == tuple(builders.READERS)
    _, expected, doc = next(key for key in schema_keys(ClsConfig) if key[0] == "data.format")
    assert expected == "one of folder, zip, tar" and all(spec.doc in doc for spec in FORMATS.values())
    read = []
    npz = replace(FORMATS["folder"], layout="{train}.npz and {val}.npz arrays", caches=True)
    monkeypatch.setitem(registry.FORMATS, "npz", npz)
    monkeypatch.setitem(
        builders.FORMAT_READERS,
        "npz",
        lambda data, aug, request: read.append((data.format, request.split, request.rank)),
    )
    cfg = typed_cls("data=folder", f"data.root={tmp_path}", "aug=none")
    data = replace(cfg.data, format="npz", cache_mode="part")
    assert build_dataset(data, cfg.aug, "val", rank=1, world=2) is None and read == [("npz", "val", 1)]
    assert dataset_problems(data) == []  # it caches: cache_mode is its key too
    assert data_root_problem(replace(data, root=str(tmp_path / "absent"))).endswith(
        "needs train.npz and val.npz arrays)"
    )
    assert dataset_problems(replace(data, format="tar")) == [
        "data.cache_mode=part: caches a zip or npz (data.format=zip or npz), not a tar"
    ]


def test_a_dataset_or_format_outside_the_schema_is_refused_before_any_reader():
    """The readers are reached only with a name the schema's Literal allows: one it does not is a config problem."""
    from cat.classification.schema import ClsConfig
    from cat.runtime.schema import schema_problems
    from tests.conftest import compose_config

    problems = schema_problems(compose_config("cls", "data=folder", "data.name=mnist", "data.format=zp"), ClsConfig)
    assert [p.split(":")[0] for p in problems] == ["data.name='mnist'", "data.format='zp'"], problems
    assert "expected one of imagenet, folder, digits, synthetic" in problems[0]
