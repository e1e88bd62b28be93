"""Tar shards (tools/pack_dataset.py --format tar, cat.data.shards): each image once when evaluating,
a fixed and equal number of samples per rank when training, a resumed epoch that continues the
stream exactly (also across DataLoader workers), and damaged shards named."""

from __future__ import annotations

import runpy
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

from cat.data.shards import ShardStream
from cat.errors import DataError
from cat.runtime.io import temporary_path
from tests.conftest import REPO


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[Path, Path]:
    """A PNG folder (3 classes; 10 train, 4 val images each) packed into ~7-image shards."""
    root = tmp_path_factory.mktemp("sharded")
    rng = np.random.default_rng(1)
    for split, count in (("train", 10), ("val", 4)):
        for name in ("a", "b", "c"):
            (root / "src" / split / name).mkdir(parents=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(
                    root / "src" / split / name / f"{i}.png"
                )
    pack = runpy.run_path(str(REPO / "tools" / "pack_dataset.py"))["main"]
    assert pack([str(root / "src"), str(root / "tar"), "--format", "tar", "--shard-mb", "0.0015"]) == 0
    return root / "src", root / "tar"


def _pixels(image: Image.Image) -> bytes:
    return np.asarray(image).tobytes()


def test_packed_into_several_shards_with_a_manifest(sharded):
    _, tar = sharded
    shards = sorted(p.name for p in tar.glob("train-*.tar"))
    assert len(shards) >= 4 and shards[0] == "train-000000.tar"
    stream = ShardStream(str(tar), "train", train=False)
    assert sum(stream.counts) == 30 and stream.classes == ["a", "b", "c"]


@pytest.mark.parametrize("world", [1, 2])
def test_evaluation_sees_every_image_once_across_ranks(sharded, world):
    source, tar = sharded
    expected = Counter((_pixels(img.convert("RGB")), label) for img, label in ImageFolder(str(source / "val")))
    seen = Counter()
    for rank in range(world):
        seen.update(
            (_pixels(img), label) for img, label in ShardStream(str(tar), "val", train=False, rank=rank, world=world)
        )
    assert seen == expected


def test_training_gives_every_rank_the_same_whole_batches(sharded):
    _, tar = sharded
    streams = [ShardStream(str(tar), "train", rank=r, world=3, batch_size=4, seed=3) for r in range(3)]
    lengths = [len(list(s)) for s in streams]
    assert lengths == [len(s) for s in streams] == [8, 8, 8]  # 30 // 3 = 10, whole batches of 4: 8


def test_the_order_is_seeded_by_epoch(sharded):
    _, tar = sharded
    stream = ShardStream(str(tar), "train", batch_size=2, seed=0, buffer=8)
    first = [_pixels(i) for i, _ in stream]
    assert [_pixels(i) for i, _ in stream] == first  # a pure function of (seed, epoch, rank, worker)
    stream.set_epoch(1)
    second = [_pixels(i) for i, _ in stream]
    assert second != first and sorted(second) == sorted(first)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_epoch_continues_the_stream_exactly(sharded, workers):
    """Skipping k batches of the rank (split over the workers as the DataLoader took them) gives
    the uninterrupted epoch's remaining batches, in order."""
    _, tar = sharded
    stream = ShardStream(str(tar), "train", batch_size=2, seed=5, buffer=4)
    stream.set_epoch(2)

    def batches() -> list[torch.Tensor]:
        loader = DataLoader(stream, batch_size=2, num_workers=workers, collate_fn=lambda b: [_pixels(i) for i, _ in b])
        return list(loader)

    whole = batches()
    stream.set_epoch(2, skip=3 * 2)
    assert batches() == whole[3:] and len(whole) == 15


def test_truncated_shard_is_named(sharded, tmp_path):
    tar = tmp_path / "tar"
    shutil.copytree(sharded[1], tar)
    shard = tar / "train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:700])
    with pytest.raises(DataError, match=r"train-000001\.tar has 700 bytes, its manifest says \d+"):
        ShardStream(str(tar), "train")
    (tar / "manifest.json").unlink()  # read as a foreign set: the header scan finds the cut
    with pytest.raises(DataError, match=r"^cannot read shard .*train-000001\.tar \(.*\): truncated") as error:
        ShardStream(str(tar), "train")
    assert "\n" not in str(error.value)


def test_a_stray_shard_is_named(sharded, tmp_path):
    tar = tmp_path / "tar"
    shutil.copytree(sharded[1], tar)
    shutil.copy(tar / "train-000000.tar", tar / "train-000099.tar")
    with pytest.raises(DataError, match=r"train-000099\.tar is not in .*manifest\.json"):
        ShardStream(str(tar), "train")


def test_ranks_deal_the_epoch_by_count_each_shard_read_once(sharded):
    """Spans of the epoch's sample sequence, not shards by index: with more ranks than shards, or shards of
    unequal counts, every rank takes its quota from its own span, the spans never overlap, and a rank opens
    only the shards its span touches."""
    _, tar = sharded
    for world in (2, 3, 16):
        streams = [ShardStream(str(tar), "train", batch_size=1, world=world, rank=r, seed=3) for r in range(world)]
        taken = [[_pixels(image) for image, _ in stream] for stream in streams]
        assert all(len(mine) == len(streams[0]) > 0 for mine in taken)
        flat = [p for mine in taken for p in mine]
        assert len(set(flat)) == len(flat)  # no image on two ranks, none twice on one
        assert sum(stream.rank_shards() for stream in streams) <= len(streams[0].shards) + world - 1


def _rewrite_shard(tar: Path, name: str, samples: list[dict]) -> None:
    """Replace shard ``name`` with ``samples`` and update its manifest entry (a well-formed but
    wrong shard: only its content is at fault)."""
    import json

    from webdataset import TarWriter

    with TarWriter(str(tar / name), encoder=False) as writer:
        for sample in samples:
            writer.write(sample)
    manifest = json.loads((tar / "manifest.json").read_text())
    manifest["files"][name].update(bytes=(tar / name).stat().st_size, images=max(len(samples), 1))
    manifest["files"][name].pop("class_counts")  # what the old packer wrote: labels are checked when read
    (tar / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ({"png": b"x"}, r"sample 00000000 in .*val-000000\.tar has no image or no \.cls label"),
        ({"cls": b"7"}, r"has no image or no \.cls label"),
        ({"png": None, "cls": b"7"}, r"val-000000\.tar \(.*manifest\.json\): label 7: not one of the 3 classes"),
    ],
    ids=["no_label", "no_image", "label_out_of_range"],
)
def test_a_bad_sample_is_named_before_reading(sharded, tmp_path, sample, message):
    """A manifest without class counts (the old packer's): the header scan finds it before training."""
    tar = tmp_path / "tar"
    shutil.copytree(sharded[1], tar)
    if sample.get("png", b"") is None:
        sample["png"] = (sharded[0] / "val" / "a" / "0.png").read_bytes()
    _rewrite_shard(tar, "val-000000.tar", [{"__key__": "00000000", **sample}])
    with pytest.raises(DataError, match=message):
        list(ShardStream(str(tar), "val", train=False))


def test_an_empty_shard_is_refused_before_reading(sharded, tmp_path):
    import json

    tar = tmp_path / "tar"
    shutil.copytree(sharded[1], tar)
    manifest = json.loads((tar / "manifest.json").read_text())
    manifest["files"]["train-000002.tar"].update(images=0, class_counts=[0, 0, 0])
    (tar / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"train-000002\.tar holds no images"):
        ShardStream(str(tar), "train")


def test_a_failed_pack_leaves_whole_files_only_and_a_killed_packs_leftovers_go(sharded, tmp_path, capsys):
    """A pack that fails part-way (the val split's classes are not train's, found after train is packed)
    writes no manifest and no partial file; what a killed pack left (atomic_write's temporary, as SIGKILL
    leaves it mid-write) is removed, and said, by the next pack into the folder."""
    from cat.data.shards import scan_shard

    source = tmp_path / "src"
    shutil.copytree(sharded[0], source)
    (source / "val" / "zebra").mkdir()
    pack = runpy.run_path(str(REPO / "tools" / "pack_dataset.py"))["main"]
    for fmt in ("tar", "zip"):
        out = tmp_path / fmt
        out.mkdir()
        leftover = Path(temporary_path(str(out / ("train-000003.tar" if fmt == "tar" else "train.zip"))))
        leftover.write_bytes(b"\0" * 4096)
        with pytest.raises(SystemExit) as code:
            pack([str(source), str(out), "--format", fmt, "--shard-mb", "0.0015"])
        captured = capsys.readouterr()
        assert code.value.code == 2 and "val has classes ['a', 'b', 'c', 'zebra']" in captured.err
        assert f"removed {leftover}, left by a pack that was killed" in captured.out
        left = sorted(p.name for p in out.iterdir())
        assert not [n for n in left if n.startswith(".")], left
        assert "manifest.json" not in left and left
        for name in left:
            if name.endswith(".tar"):
                scan_shard(str(out / name), 1 << 20)  # whole: read to its end-of-archive blocks


@pytest.mark.parametrize("labels_only", [False, True], ids=["stream", "header-scan"])
def test_reading_a_shard_keeps_no_member_it_passed(tmp_path, labels_only):
    """tarfile lists every member it has read: a worker skipping to its span of a 1 GB shard held them all."""
    import gc
    import tarfile

    from cat.data.shards import shard_samples

    path = tmp_path / "big-000000.tar"
    _write_shard(path, 2000)
    gc.collect()
    held = []
    for position, _ in enumerate(shard_samples(str(path), 1 << 20, labels_only=labels_only)):
        if position in (100, 1900):
            held.append(sum(isinstance(o, tarfile.TarInfo) for o in gc.get_objects()))
    assert position == 1999 and max(held) <= 4 and held[0] == held[1]


def _write_shard(path: Path, samples: int) -> None:
    import io
    import tarfile

    with tarfile.open(path, "w") as archive:
        for key in range(samples):
            for field, data in (("png", b"\x89PNG" + bytes(60)), ("cls", b"1")):
                info = tarfile.TarInfo(f"{key:06d}.{field}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
