"""Tar shards train as well as the folder they came from: the packer writes a shuffled order, a stream's
batches cover the classes as a folder's shuffle does, class-sorted shards are warned about, and shards
another tool wrote (webdataset's ShardWriter, no manifest) train like packed ones.

The data: scikit-learn's digits as 32x32 JPEGs (1,437 train / 360 val, 10 classes), where a small model
trained a few epochs is far from saturation, so an order that costs accuracy shows."""

from __future__ import annotations

import json
import logging
import os
import random
import runpy
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

import cat
from cat.data import build_dataset
from cat.data.shards import shard_samples
from cat.runtime.rng import seed_everything
from tests.conftest import REPO


def _shard_writer(out: Path, split: str, samples: list[tuple[str, int]]) -> None:
    """Shards as webdataset's ShardWriter writes them (no manifest), ~300 samples each."""
    from webdataset import ShardWriter

    with ShardWriter(str(out / f"{split}-%06d.tar"), maxcount=300, encoder=False, verbose=0) as sink:
        for index, (path, label) in enumerate(samples):
            sink.write({"__key__": f"{index:06d}", "jpg": Path(path).read_bytes(), "cls": str(label).encode()})


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> dict[str, Path]:
    """The digits as a JPEG folder; packed (tools/pack_dataset.py, shards of ~0.3 MB: 5 for train); and as
    foreign shards, written in a random order and in the folder's order (the old packer's layout)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    root = tmp_path_factory.mktemp("digits")
    bundled = load_digits()
    train, val = train_test_split(
        np.arange(len(bundled.target)), test_size=0.2, random_state=0, stratify=bundled.target
    )
    for split, indices in (("train", train), ("val", val)):
        for i in indices:
            folder = root / "folder" / split / str(bundled.target[i])
            folder.mkdir(parents=True, exist_ok=True)
            pixels = (bundled.images[i] * 255 / 16).astype(np.uint8)
            Image.fromarray(pixels).resize((32, 32), Image.BILINEAR).convert("RGB").save(folder / f"{i:04d}.jpg")
    pack = runpy.run_path(str(REPO / "tools" / "pack_dataset.py"))["main"]
    assert pack([str(root / "folder"), str(root / "packed"), "--format", "tar", "--shard-mb", "0.3"]) == 0
    for name in ("shuffled", "sorted"):
        (root / name).mkdir()
        for split in ("train", "val"):
            samples = ImageFolder(str(root / "folder" / split)).samples
            if name == "shuffled":
                random.Random(0).shuffle(samples)
            _shard_writer(root / name, split, samples)
    return {name: root / name for name in ("folder", "packed", "shuffled", "sorted")}


def _config(root: Path, fmt: str) -> tuple:
    data = OmegaConf.load(REPO / "configs" / "cls" / "data" / "imagenet.yaml")
    data.merge_with({"name": "folder", "root": str(root), "format": fmt, "num_classes": None, "img_size": 32})
    data.shuffle_buffer = 100  # a third of a shard, as 1,000 is of an ImageNet shard of ~4,500 images
    aug = OmegaConf.load(REPO / "configs" / "cls" / "aug" / "deit.yaml")
    aug.merge_with(OmegaConf.load(REPO / "configs" / "cls" / "aug" / "none.yaml"))
    aug.pop("defaults", None)
    return data, aug


def _epoch_batches(root: Path, fmt: str, seed: int, epoch: int, batch: int) -> DataLoader:
    """The training batches of one epoch as the trainer draws them: a folder through a seeded shuffle,
    a stream through its own order."""
    dataset = build_dataset(*_config(root, fmt), "train", batch_size=batch, seed=seed)
    if fmt == "tar":
        dataset.set_epoch(epoch)
        return DataLoader(dataset, batch_size=batch)
    generator = torch.Generator().manual_seed(seed * 1000 + epoch)
    return DataLoader(dataset, batch_size=batch, shuffle=True, generator=generator, drop_last=True)


def _classes_per_batch(root: Path, fmt: str, batches: int = 6, batch: int = 32) -> float:
    """The mean number of classes in each of an epoch's first batches, over two seeds."""
    counts = []
    for seed in (0, 1):
        for index, (_, labels) in enumerate(_epoch_batches(root, fmt, seed, 0, batch)):
            if index == batches:
                break
            counts.append(len(set(labels.tolist())))
    return statistics.mean(counts)


def test_the_first_batches_of_a_packed_stream_cover_the_classes_as_a_folders_shuffle(digits):
    """10 classes, batches of 32: a uniform shuffle gives ~9.7 classes a batch; shards written class by class
    (the old packer's order) give ~2, which the same test tells apart."""
    folder = _classes_per_batch(digits["folder"], "folder")
    assert folder >= 9
    assert _classes_per_batch(digits["packed"], "tar") >= folder - 0.5
    assert _classes_per_batch(digits["shuffled"], "tar") >= folder - 0.5
    assert _classes_per_batch(digits["sorted"], "tar") <= 4


def test_class_sorted_shards_are_warned_about_once_naming_them(digits, caplog):
    with caplog.at_level(logging.WARNING, logger="cat.data"):
        build_dataset(*_config(digits["packed"], "tar"), "train")
        build_dataset(*_config(digits["shuffled"], "tar"), "train")
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="cat.data"):
        build_dataset(*_config(digits["sorted"], "tar"), "train")
        build_dataset(*_config(digits["sorted"], "tar"), "val")  # evaluation's order does not matter
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert message.startswith("5 of 5 training shards are class-sorted (train-000000.tar (3 of 10 classes), ")
    assert "Re-pack with tools/pack_dataset.py --format tar" in message


def test_shards_of_the_old_packer_are_warned_about_from_their_headers(digits, tmp_path, caplog):
    """Its manifest has counts but no class counts, and it wrote the folder's order."""
    old = Path(shutil.copytree(digits["sorted"], tmp_path / "old"))
    files = {
        p.name: {"bytes": p.stat().st_size, "images": len(list(shard_samples(str(p), 1 << 20))), "sha256": "0" * 64}
        for p in old.glob("*.tar")
    }
    (old / "manifest.json").write_text(
        json.dumps({"format": "tar", "classes": [str(i) for i in range(10)], "files": files})
    )
    with caplog.at_level(logging.WARNING, logger="cat.data"):
        build_dataset(*_config(old, "tar"), "train")
    assert len(caplog.records) == 1 and "5 of 5 training shards are class-sorted" in caplog.records[0].getMessage()


def _top1(root: Path, fmt: str, seed: int, epochs: int = 2) -> float:
    """A small CA-DeiT trained ``epochs`` on the split as the format delivers it, then evaluated."""
    seed_everything(seed)  # torch's, numpy's and Python's: timm's crops draw from the last
    data, aug = _config(root, fmt)
    val = build_dataset(data, aug, "val", num_classes=10)
    model = cat.create_model("ca_deit_tiny", num_classes=10, img_size=32, embed_dim=32, depth=1, patch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model.train()
    for epoch in range(epochs):
        for images, labels in _epoch_batches(root, fmt, seed, epoch, 32):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    hits = total = 0
    with torch.no_grad():
        for images, labels in DataLoader(val, batch_size=128):
            hits += (model(images).argmax(1) == labels).sum().item()
            total += len(labels)
    return 100 * hits / total


@pytest.mark.slow
def test_packed_and_foreign_shards_train_as_well_as_the_folder(digits):
    """Three seeds each, 2 epochs: top-1 ~27% (10% is chance), far from saturation. Packed and foreign shards stay
    within twice the seeds' spread of the folder's mean; class-sorted shards (the control: the old packer's order)
    fall towards chance, so the test sees an order that costs accuracy. Every RNG is seeded: the same numbers on
    every run."""
    torch.set_num_threads(1)
    runs = {
        name: [_top1(digits[name], "folder" if name == "folder" else "tar", seed) for seed in seeds]
        for name, seeds in (("folder", range(3)), ("packed", range(3)), ("shuffled", range(3)), ("sorted", range(3)))
    }
    means = {name: statistics.mean(accuracies) for name, accuracies in runs.items()}
    assert 20 <= means["folder"] <= 80, runs  # away from chance and from saturation
    for name in ("packed", "shuffled"):
        noise = max(statistics.stdev(runs["folder"]), statistics.stdev(runs[name]), 2.0)
        assert means[name] >= means["folder"] - 2 * noise, runs
    assert means["sorted"] <= means["folder"] - 10, runs


def test_foreign_shards_are_scanned_once_into_the_runs_folder_not_the_datas(digits, tmp_path):
    """The header scan is cached in the run's folder (the data's may be read-only, and is shared), keyed by each
    shard's size, times and inode: a shard rewritten under the same size, its modification time set back, is
    rescanned (its change time moved), as is one with a new time."""
    from cat.data.shards import ShardStream
    from cat.errors import DataError

    data = Path(shutil.copytree(digits["shuffled"], tmp_path / "data"))
    before = sorted(p.name for p in data.iterdir())
    run = tmp_path / "run"
    assert sum(ShardStream(str(data), "train", index_dir=str(run)).counts) == 1437
    assert sorted(p.name for p in data.iterdir()) == before and len(list(run.glob(".shard-index-*.json"))) == 1
    shard = data / "train-000002.tar"
    stamp = shard.stat()
    shard.write_bytes(bytes(range(256)) * (stamp.st_size // 256) + bytes(stamp.st_size % 256))
    os.utime(shard, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert shard.stat().st_size == stamp.st_size and shard.stat().st_mtime_ns == stamp.st_mtime_ns
    with pytest.raises(DataError, match=r"cannot read shard .*train-000002\.tar"):
        ShardStream(str(data), "train", index_dir=str(run))
    with pytest.raises(DataError, match=r"cannot read shard .*train-000002\.tar"):
        ShardStream(str(data), "train")  # no cache: scanned
    os.utime(shard)
    with pytest.raises(DataError, match=r"cannot read shard .*train-000002\.tar"):
        ShardStream(str(data), "train", index_dir=str(run))


@pytest.mark.parametrize(
    "lie",
    ["more classes", "negative count", "1e30 images", "non-digit label", "deep nesting", "a folder", "sealed lie"],
)
def test_a_lying_shard_index_is_rescanned_or_named(digits, tmp_path, lie):
    """The shard-index cache is the user's file like any other: one edited by anyone without the user's seal key
    (here: any edit, its seal left as it was) is rescanned, never believed (a forged one made a 16-class model from
    2-class shards); labels that lie under a seal that holds (only the user could make it) are named by the first
    full read of the shard."""
    from cat.data.shards import ShardStream
    from cat.errors import DataError, OutputError
    from cat.runtime.seal import seal

    data = Path(shutil.copytree(digits["shuffled"], tmp_path / "data"))
    run = tmp_path / "run"
    honest = ShardStream(str(data), "val", train=False, index_dir=str(run))
    [cache] = run.glob(".shard-index-*.json")
    record = json.loads(cache.read_text())
    index = record["shards"]
    name = sorted(index)[0]
    entry = index[name]
    if lie in ("more classes", "sealed lie"):  # the same count, spread over 16 labels
        entry["labels"] = {str(k): entry["images"] // 16 + (k < entry["images"] % 16) for k in range(16)}
    elif lie == "negative count":
        entry["labels"] = {"0": -1, "1": entry["images"] + 1}
    elif lie == "1e30 images":
        entry["images"], entry["labels"] = 10**30, {"0": 10**30}
    elif lie == "non-digit label":
        entry["labels"] = {"x": entry["images"]}
    if lie == "sealed lie":
        record["seal"] = seal(index)
    text = json.dumps(record)
    if lie == "deep nesting":
        text = '{"seal": ' + json.dumps(record["seal"]) + ', "shards": ' + "[" * 50_000 + "]" * 50_000 + "}"
    if lie == "a folder":
        cache.unlink()
        cache.mkdir()
        with pytest.raises(OutputError, match=r"\.shard-index-.*\.json is a folder, not a regular file"):
            ShardStream(str(data), "val", train=False, index_dir=str(run))
        return
    cache.write_text(text)
    stream = ShardStream(str(data), "val", train=False, index_dir=str(run))
    if lie != "sealed lie":  # rescanned: what the headers say
        assert stream.num_classes == honest.num_classes == 10 and stream.counts == honest.counts
        return
    assert stream.num_classes == 16 and honest.num_classes < 16  # believed until the shard is read...
    with pytest.raises(DataError, match=rf"{name} holds labels .* says .*the index is stale"):
        list(stream)  # ...then named
