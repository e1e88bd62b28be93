"""The zip layout (tools/pack_dataset.py, cat.data.packed): the same images and labels as the folder,
each rank's share under cache_mode=part, and damaged or hostile files refused with one line naming them."""

from __future__ import annotations

import io
import json
import runpy
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torchvision.datasets import ImageFolder

from cat.data import ZipImageDataset
from cat.data.packed import RankShardSampler
from cat.errors import DataError
from tests.conftest import REPO

CLASSES = ("cat", "dog", "eel")


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path]:
    """A small JPEG folder (3 classes, 7 train and 3 val images each, odd sizes) and its zip."""
    root = tmp_path_factory.mktemp("packed")
    rng = np.random.default_rng(0)
    for split, count in (("train", 7), ("val", 3)):
        for name in CLASSES:
            (root / "src" / split / name).mkdir(parents=True)
            for i in range(count):
                size = (int(rng.integers(20, 60)), int(rng.integers(20, 60)), 3)
                image = Image.fromarray(rng.integers(0, 255, size, dtype=np.uint8))
                image.save(root / "src" / split / name / f"{i}.jpg", quality=int(rng.integers(75, 96)))
    pack = runpy.run_path(str(REPO / "tools" / "pack_dataset.py"))["main"]
    assert pack([str(root / "src"), str(root / "zip")]) == 0
    return root / "src", root / "zip"


def _copy(packed_root: Path, tmp_path: Path) -> Path:
    shutil.copytree(packed_root, tmp_path / "zip")
    return tmp_path / "zip"


@pytest.mark.parametrize("split", ["train", "val"])
@pytest.mark.parametrize("cache_mode", ["no", "full"])
def test_same_images_and_labels_as_the_folder(packed, split, cache_mode):
    source, zipped = packed
    folder = ImageFolder(str(source / split))
    dataset = ZipImageDataset(str(zipped), split, cache_mode=cache_mode)
    assert dataset.classes == folder.classes == list(CLASSES) and dataset.targets.tolist() == folder.targets
    for index in range(len(folder)):
        image, label = dataset[index]
        expected, expected_label = folder[index]
        assert label == expected_label and np.array_equal(np.asarray(image), np.asarray(expected.convert("RGB")))


def test_manifest_names_every_file_with_its_size_count_and_hash(packed):
    _, zipped = packed
    manifest = json.loads((zipped / "manifest.json").read_text())
    assert manifest["classes"] == list(CLASSES)
    assert manifest["files"]["train.zip"]["images"] == 21 and manifest["files"]["val_map.txt"]["images"] == 9
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (zipped / name).stat().st_size and len(entry["sha256"]) == 64


def test_part_holds_and_samples_only_its_share(packed):
    _, zipped = packed
    shares = [ZipImageDataset(str(zipped), "train", cache_mode="part", rank=r, world=3) for r in range(3)]
    held = [set(d.cached_indices()) for d in shares]
    assert set().union(*held) == set(range(21)) and sum(len(h) for h in held) == 21  # disjoint, complete
    full = ZipImageDataset(str(zipped), "train", cache_mode="full")
    assert sum(d.cached_bytes() for d in shares) == full.cached_bytes()
    for share, indices in zip(shares, held, strict=True):  # each share's one buffer holds its own images
        assert all(np.array_equal(np.asarray(share[i][0]), np.asarray(full[i][0])) for i in indices)
    samplers = [RankShardSampler(21, r, 3, seed=5) for r in range(3)]
    for sampler, share in zip(samplers, held, strict=True):
        sampler.set_epoch(0)
        first = list(sampler)
        sampler.set_epoch(1)
        assert set(first) == set(sampler) <= share and len(first) == 7 and first != list(sampler)
    with pytest.raises(IndexError, match="not in rank 0's share"):
        shares[0][1]


def test_part_sampler_gives_every_rank_the_same_length():
    lengths = {len(RankShardSampler(10, r, 4)) for r in range(4)}
    assert lengths == {2}


def test_truncated_zip_is_named(packed, tmp_path):
    zipped = _copy(packed[1], tmp_path)
    data = (zipped / "train.zip").read_bytes()
    (zipped / "train.zip").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"train\.zip has \d+ bytes, its manifest says \d+: the file is truncated"):
        ZipImageDataset(str(zipped), "train")
    (zipped / "manifest.json").unlink()  # without the manifest: zipfile finds no central directory
    with pytest.raises(DataError, match=r"cannot open .*train\.zip .*truncated or not a zip file"):
        ZipImageDataset(str(zipped), "train")


def test_altered_image_bytes_are_named_when_read(packed, tmp_path):
    """Same size, one byte changed inside an image: the zip's CRC catches it on read."""
    zipped = _copy(packed[1], tmp_path)
    with zipfile.ZipFile(zipped / "train.zip") as z:
        info = z.getinfo("dog/2.jpg")
    data = bytearray((zipped / "train.zip").read_bytes())
    offset = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + 100
    data[offset] ^= 0xFF
    (zipped / "train.zip").write_bytes(bytes(data))
    dataset = ZipImageDataset(str(zipped), "train")
    index = [m for m, _ in dataset.samples].index("dog/2.jpg")
    with pytest.raises(DataError, match=r"cannot read dog/2\.jpg from .*train\.zip .*CRC"):
        dataset[index]
    with pytest.raises(DataError, match=r"cannot read dog/2\.jpg"):  # cached modes read everything up front
        ZipImageDataset(str(zipped), "train", cache_mode="full")


@pytest.mark.parametrize(
    ("listing", "message"),
    [
        ("cat/0.jpg 0\n", r"train_map\.txt, line 1: expected '<path in the zip><TAB><label>'"),
        ("cat/0.jpg\tzero\n", r"line 1: label .zero. is not a class index"),
        ("cat/99.jpg\t0\n", r"has no member 'cat/99\.jpg'"),
        ("\n", r"lists no images"),
    ],
)
def test_bad_image_list_is_named(packed, tmp_path, listing, message):
    zipped = _copy(packed[1], tmp_path)
    (zipped / "train_map.txt").write_text(listing)
    (zipped / "manifest.json").unlink()
    with pytest.raises(DataError, match=message):
        ZipImageDataset(str(zipped), "train")


def test_verify_finds_an_altered_file(packed, tmp_path, run_tool):
    zipped = _copy(packed[1], tmp_path)
    assert run_tool("pack_dataset", "--verify", str(zipped)).strip().endswith("ok")
    listing = (zipped / "val_map.txt").read_text()
    (zipped / "val_map.txt").write_text(listing.replace("\t1", "\t2", 1))  # a relabelled image
    report = run_tool("pack_dataset", "--verify", str(zipped), expect=1)
    assert "val_map.txt: sha256 differs from the manifest's" in report


def test_verify_packs_then_checks_and_names_what_is_no_packed_root(packed, tmp_path, run_tool):
    """--verify with an output folder checks what was just packed; alone, on a folder that is no packed root (the
    image folder itself) or under a hostile manifest, it says so instead of a traceback or reading elsewhere."""
    source = packed[0]
    report = run_tool("pack_dataset", str(source), str(tmp_path / "tar"), "--format", "tar", "--verify")
    assert report.strip().endswith("ok") and (tmp_path / "tar" / "manifest.json").is_file()
    error = run_tool("pack_dataset", "--verify", str(source), expect=2, stderr=True)
    assert error.strip() == (
        f"error: no {source / 'manifest.json'}: {source} is not a packed root (tools/pack_dataset.py writes one there)"
    )
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    (hostile / "manifest.json").write_text('{"files": {"../zip/val.zip": {"sha256": "0"}}}')
    report = run_tool("pack_dataset", "--verify", str(hostile), expect=1)
    assert report.splitlines() == [
        f"{hostile / 'manifest.json'}: '../zip/val.zip' is not an entry for a file of {hostile}",
        "1 problem(s)",
    ]
    (hostile / "manifest.json").write_text('{"files": {"val.zip": 3}}')
    error = run_tool("pack_dataset", "--verify", str(hostile), expect=2, stderr=True)
    assert error.strip() == (
        f"error: {hostile / 'manifest.json'} is not a dataset manifest (files['val.zip'] must be an object, got 3); "
        "re-run tools/pack_dataset.py"
    )


def test_a_worker_process_opens_its_own_zip(packed):
    """A dataset pickled into a worker (spawn) or forked drops its handle and reopens the zip."""
    import pickle

    _, zipped = packed
    dataset = ZipImageDataset(str(zipped), "val")
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy._file is None and np.array_equal(np.asarray(copy[0][0]), np.asarray(dataset[0][0]))


def test_a_zip_without_its_image_list_is_named(packed, tmp_path):
    zipped = _copy(packed[1], tmp_path)
    (zipped / "val_map.txt").unlink()
    with pytest.raises(DataError, match=r"no image list .*val_map\.txt \(the zip layout"):
        ZipImageDataset(str(zipped), "val")


def test_a_label_beyond_the_manifests_classes_is_named(packed, tmp_path):
    zipped = _copy(packed[1], tmp_path)
    lines = (zipped / "train_map.txt").read_text().splitlines()
    lines[0] = lines[0].rsplit("\t", 1)[0] + "\t3"
    (zipped / "train_map.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"train_map\.txt, line 1: label 3: not one of the 3 classes"):
        ZipImageDataset(str(zipped), "train")


@pytest.mark.parametrize("text", ["{not json", '["a list"]', '{"files": 3}'])
def test_a_broken_manifest_is_named(packed, tmp_path, text):
    zipped = _copy(packed[1], tmp_path)
    (zipped / "manifest.json").write_text(text)
    with pytest.raises(DataError, match=r"manifest\.json is not a dataset manifest .*re-run tools/pack_dataset\.py"):
        ZipImageDataset(str(zipped), "val")


def test_a_split_folder_that_is_not_there_is_named_before_anything_is_written(packed, tmp_path, run_tool):
    folder = packed[0]
    out = tmp_path / "out"
    error = run_tool("pack_dataset", str(folder), str(out), "--splits", "train", "test", expect=2, stderr=True)
    assert f"no {folder / 'test'} folder to pack" in error and not out.exists()


def test_max_side_resizes_and_names_a_file_that_is_no_image(packed, tmp_path, run_tool):
    """--max-side: images over the side stored at it (aspect kept, as JPEGs), smaller ones byte for byte; a file
    posing as an image is one line naming it, and no archive is left half written."""
    source = tmp_path / "src"
    shutil.copytree(packed[0], source)
    big = Image.fromarray(np.random.default_rng(1).integers(0, 255, (90, 120, 3), dtype=np.uint8))
    big.save(source / "train" / "cat" / "big.jpg", quality=90)
    assert run_tool("pack_dataset", str(source), str(tmp_path / "small"), "--max-side", "60", "--splits", "train")
    with zipfile.ZipFile(tmp_path / "small" / "train.zip") as z:
        resized = Image.open(io.BytesIO(z.read("cat/big.jpg")))
        assert resized.size == (60, 45) and resized.format == "JPEG"
        assert z.read("cat/0.jpg") == (source / "train" / "cat" / "0.jpg").read_bytes()  # under 60: as it was
    assert json.loads((tmp_path / "small" / "manifest.json").read_text())["max_side"] == 60
    (source / "train" / "dog" / "fake.jpg").write_bytes(b"#!/bin/sh\necho not an image\n")
    out = tmp_path / "hostile"
    error = run_tool(
        "pack_dataset", str(source), str(out), "--max-side", "60", "--splits", "train", expect=2, stderr=True
    )
    assert f"cannot read image {source / 'train' / 'dog' / 'fake.jpg'} (not an image PIL can identify)" in error
    assert not (out / "train.zip").exists() and "Traceback" not in error
