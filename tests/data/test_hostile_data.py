"""The hostile-data suite: what a user who shares datasets on a cluster could put in a folder, an archive or a
manifest, each refused in one line naming the file or member (or, for the packer, named and left out), before
any training where it can be checked cheaply. Numbers refer to issue 54's items."""

from __future__ import annotations

import json
import logging
import os
import runpy
import shutil
import struct
import threading
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cat.data import ZipImageDataset, load_rgb
from cat.data.shards import ShardStream, scan_shard, shard_samples
from cat.errors import DataError
from tests.conftest import REPO

CLASSES = ("a", "b", "c")
pack = runpy.run_path(str(REPO / "tools" / "pack_dataset.py"))["main"]


def _png(rng: np.random.Generator) -> bytes:
    import io

    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """3 classes of 8 train and 3 val PNGs."""
    root = tmp_path_factory.mktemp("hostile_src")
    rng = np.random.default_rng(0)
    for split, count in (("train", 8), ("val", 3)):
        for name in CLASSES:
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                (root / split / name / f"{i}.png").write_bytes(_png(rng))
    return root


@pytest.fixture(scope="module")
def packed(source, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("hostile_packed")
    assert pack([str(source), str(out / "zip")]) == 0
    assert pack([str(source), str(out / "tar"), "--format", "tar", "--shard-mb", "0.002"]) == 0
    return {"zip": out / "zip", "tar": out / "tar"}


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def _edit_manifest(root: Path, edit: Callable[[dict], None]) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    edit(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))


def _within(seconds: float, call: Callable[[], object]) -> BaseException | None:
    """What ``call`` raised, failing the test if it has not returned after ``seconds`` (a blocked open)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still blocked after {seconds} s"
    return outcome[0]


def _one_line(error: BaseException | None, *fragments: str) -> None:
    assert isinstance(error, DataError), error
    assert "\n" not in str(error), str(error)
    for fragment in fragments:
        assert fragment in str(error), str(error)


def _archives_text(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in folder.iterdir() if p.is_file())


# 1. The packer takes nothing from outside its source folder.
@pytest.mark.parametrize("fmt", ["zip", "tar"])
def test_packer_refuses_a_link_out_of_its_source_and_names_it(source, tmp_path, capsys, fmt):
    secret = tmp_path / "shadow"
    secret.write_bytes(b"root:SECRET-HASH-0123456789:19000:0:99999:7:::\n")
    src = _copy(source, tmp_path)
    (src / "train" / "a" / "x.png").symlink_to(secret)
    assert pack([str(src), str(tmp_path / "out"), "--format", fmt, "--shard-mb", "0.002"]) == 0
    captured = capsys.readouterr()
    assert f"refused {src / 'train' / 'a' / 'x.png'}: leads outside the dataset's folder (to {secret})" in captured.err
    assert "train: 24 images" in captured.out and "(1 refused: listed above)" in captured.out
    assert b"SECRET-HASH" not in _archives_text(tmp_path / "out")


def test_packer_does_not_follow_a_folder_loop(source, tmp_path, capsys):
    """``ln -s .. train/a/loop`` multiplied 16 images into 656 (320 mislabelled) when links were followed."""
    src = _copy(source, tmp_path)
    (src / "train" / "a" / "loop").symlink_to("..")
    assert pack([str(src), str(tmp_path / "out"), "--format", "zip"]) == 0
    captured = capsys.readouterr()
    assert f"refused {src / 'train' / 'a' / 'loop'}: a symbolic link to a folder (not followed)" in captured.err
    assert len((tmp_path / "out" / "train_map.txt").read_text().splitlines()) == 24


def test_folder_reader_takes_the_packers_rule(source, tmp_path, caplog):
    """``data=folder`` reads what the packer packs: a link to a folder outside (``/usr/share``) or back into the
    class folder (``loop -> .``) is not entered, a file linked from outside is left out, one line counts them;
    a linked class folder is refused by name."""
    from cat.data import build_dataset
    from tests.conftest import compose_config

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "stray.png").write_bytes((source / "train" / "b" / "0.png").read_bytes())
    src = _copy(source, tmp_path)
    (src / "train" / "a" / "usr_share").symlink_to(outside)
    (src / "train" / "a" / "loop").symlink_to(".")
    (src / "train" / "a" / "linked.png").symlink_to(outside / "stray.png")
    cfg = compose_config("cls", "data=folder", f"data.root={src}", "data.img_size=32", "aug=none")
    data_log = logging.getLogger("cat.data")  # the run's logger may not propagate to caplog's: listen on it
    data_log.addHandler(caplog.handler)
    try:
        dataset = build_dataset(cfg.data, cfg.aug, "train")
    finally:
        data_log.removeHandler(caplog.handler)
    assert len(dataset) == 24 and [label for _, label in dataset.samples].count(0) == 8
    assert all(os.path.realpath(path).startswith(str(src)) for path, _ in dataset.samples)
    [line] = {r.getMessage() for r in caplog.records if "left out" in r.getMessage()}
    assert "3 entries left out" in line and "usr_share: a symbolic link to a folder (not followed)" in line
    (src / "train" / "d").symlink_to(outside)
    with pytest.raises(DataError, match=f"{src / 'train' / 'd'} is a symbolic link to a folder"):
        build_dataset(cfg.data, cfg.aug, "train")


@pytest.mark.parametrize("where", ["inside a split", "the source itself", "a file", "under /proc"])
def test_packer_output_it_cannot_own_is_one_line(source, tmp_path, run_tool, where):
    """``pack_dataset.py SRC SRC/train/packed`` made a phantom class ``packed`` once the folder existed; an existing
    file or a folder under /proc ended in a traceback."""
    src = _copy(source, tmp_path)
    (tmp_path / "a_file").write_text("mine")
    out = {
        "inside a split": src / "train" / "packed",
        "the source itself": src,
        "a file": tmp_path / "a_file",
        "under /proc": Path("/proc/cat-pack"),
    }[where]
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    error = run_tool("pack_dataset", str(src), str(out), expect=2, stderr=True)
    assert error.count("\n") == 1 and str(out) in error, error
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "a_file").read_text() == "mine"


def test_packer_refuses_an_image_over_the_size_bound_unread(source, tmp_path, capsys):
    src = _copy(source, tmp_path)
    huge = src / "train" / "a" / "huge.png"
    with open(huge, "wb") as f:  # sparse: 3 GiB on paper, nothing on disk
        f.truncate(3 << 30)
    assert pack([str(src), str(tmp_path / "out")]) == 0
    assert f"refused {huge}: 3221.2 MB, over the" in capsys.readouterr().err


def test_packer_refuses_a_linked_class_folder_and_a_non_utf8_name_in_one_line(source, tmp_path, run_tool):
    src = _copy(source, tmp_path)
    (src / "train" / "d").symlink_to(tmp_path)
    error = run_tool("pack_dataset", str(src), str(tmp_path / "out"), expect=2, stderr=True)
    assert error.count("\n") == 1 and f"{src / 'train' / 'd'} is a symbolic link to a folder" in error
    (src / "train" / "d").unlink()
    os.mkdir(os.fsencode(src / "train") + b"/caf\xe9")
    error = run_tool("pack_dataset", str(src), str(tmp_path / "out"), expect=2, stderr=True)
    assert error.count("\n") == 1 and "caf\\xe9': its name is not UTF-8; rename it" in error


# 2. No shard path reaches a shell.
def test_a_pipe_root_is_a_folder_name_and_runs_nothing(packed, tmp_path, monkeypatch):
    """webdataset's URL opener runs ``pipe:`` paths through a shell (shown, with a harmless ``touch``); the
    reader opens shards as local files, so the same folder is only read."""
    from webdataset.gopen import gopen

    monkeypatch.chdir(tmp_path)
    root = Path("pipe:touch MARKER;true ")
    shutil.copytree(packed["tar"], root)
    stream = ShardStream(str(root), "val", train=False)
    assert len(list(stream)) == 9 and not Path("MARKER").exists()
    gopen(stream.shards[0]).close()  # the old path
    assert Path("MARKER").exists()


# 3. Only regular files are opened.
def test_a_fifo_named_like_a_shard_is_refused_at_once(packed, tmp_path):
    tar = _copy(packed["tar"], tmp_path)
    (tar / "val-000000.tar").unlink()
    os.mkfifo(tar / "val-000000.tar")
    _one_line(_within(10, lambda: ShardStream(str(tar), "val", train=False)), "val-000000.tar is a FIFO")


@pytest.mark.parametrize("name", ["train.zip", "train_map.txt", "manifest.json"])
def test_a_fifo_in_a_zip_split_is_refused_at_once(packed, tmp_path, name):
    zipped = _copy(packed["zip"], tmp_path)
    (zipped / name).unlink()
    os.mkfifo(zipped / name)
    _one_line(_within(10, lambda: ZipImageDataset(str(zipped), "train")), f"{name} is a FIFO")


def test_a_fifo_image_in_a_folder_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / "x.jpg")
    _one_line(_within(10, lambda: load_rgb(str(tmp_path / "x.jpg"))), "x.jpg is a FIFO, not a regular file")


# 4. Counts are checked against what the files can hold.
def test_an_image_count_the_shard_cannot_hold_is_one_line(packed, tmp_path):
    tar = _copy(packed["tar"], tmp_path)
    _edit_manifest(tar, lambda m: m["files"]["train-000000.tar"].update(images=10**12, class_counts=[10**12, 0, 0]))
    with pytest.raises(
        DataError, match=r"train-000000\.tar: its manifest says 1000000000000 images, but its \d+ bytes"
    ):
        ShardStream(str(tar), "train")


def test_a_tar_manifest_entry_without_its_image_count_is_one_line(packed, tmp_path):
    tar = _copy(packed["tar"], tmp_path)
    _edit_manifest(tar, lambda m: m["files"]["train-000000.tar"].pop("images"))
    with pytest.raises(DataError, match=r"files\['train-000000\.tar'\] has no 'images' count; re-run"):
        ShardStream(str(tar), "train")


# 5. One image's size is bounded before it is read or inflated.
def _bomb(size: int) -> bytes:
    return bytes(size)  # zeros: deflate and gzip shrink them ~1000x


def test_a_zip_bomb_member_is_refused_from_the_directory(tmp_path):
    root = tmp_path / "zip"
    root.mkdir()
    with zipfile.ZipFile(root / "train.zip", "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("a/bomb.png", _bomb(3_000_000))
    (root / "train_map.txt").write_text("a/bomb.png\t0\n")
    assert (root / "train.zip").stat().st_size < 20_000
    for cache_mode in ("no", "full"):
        with pytest.raises(DataError, match=r"a/bomb\.png in .*train\.zip is 3\.0 MB, over data\.max_image_mb=1 "):
            ZipImageDataset(str(root), "train", cache_mode=cache_mode, max_image_mb=1)


def test_a_gzipped_shard_bomb_is_refused_from_its_header(tmp_path):
    import gzip
    import io
    import tarfile

    root = tmp_path / "tar"
    root.mkdir()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in (("0.png", _bomb(3_000_000)), ("0.cls", b"0")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    (root / "train-000000.tar").write_bytes(gzip.compress(buffer.getvalue()))
    with pytest.raises(DataError, match=r"member 0\.png of .*train-000000\.tar is 3\.0 MB, over data\.max_image_mb=1"):
        ShardStream(str(root), "train", num_classes=1, max_image_mb=1)


def test_an_image_file_over_the_bound_is_refused(tmp_path):
    (tmp_path / "big.png").write_bytes(_bomb(2_000_000))
    with pytest.raises(DataError, match=r"image .*big\.png is 2\.0 MB, over data\.max_image_mb=1"):
        load_rgb(str(tmp_path / "big.png"), max_image_mb=1)


def _pixel_bomb() -> bytes:
    """A tiny PNG whose header claims 20000 x 20000 pixels: PIL refuses to open it (DecompressionBombError)."""
    header = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + header
    ihdr = struct.pack(">I", len(header)) + chunk + struct.pack(">I", zlib.crc32(chunk))
    return b"\x89PNG\r\n\x1a\n" + ihdr + struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND"))


def test_a_pixel_bomb_is_one_line_naming_the_image_in_every_format(tmp_path):
    bomb = _pixel_bomb()
    with pytest.raises(Image.DecompressionBombError):  # what PIL raises: a traceback without a file name
        Image.open(__import__("io").BytesIO(bomb))
    (tmp_path / "bomb.png").write_bytes(bomb)
    with pytest.raises(DataError, match=r"cannot read image .*bomb\.png \(DecompressionBombError: "):
        load_rgb(str(tmp_path / "bomb.png"))
    root = tmp_path / "zip"
    root.mkdir()
    with zipfile.ZipFile(root / "train.zip", "w") as z:
        z.writestr("a/bomb.png", bomb)
    (root / "train_map.txt").write_text("a/bomb.png\t0\n")
    with pytest.raises(DataError, match=r"cannot read a/bomb\.png in .*train\.zip \(DecompressionBombError"):
        ZipImageDataset(str(root), "train")[0]
    from webdataset import TarWriter

    (tmp_path / "tar").mkdir()
    with TarWriter(str(tmp_path / "tar" / "train-000000.tar"), encoder=False) as writer:
        writer.write({"__key__": "k0", "png": bomb, "cls": b"0"})
    with pytest.raises(DataError, match=r"cannot read sample k0 in .*train-000000\.tar \(DecompressionBombError"):
        list(ShardStream(str(tmp_path / "tar"), "train", train=False))


# 6. Labels are 0 ... K-1.
def test_a_tar_manifest_without_classes_takes_k_from_the_labels(packed, tmp_path):
    """It trained a 0-class model (the features taken as logits)."""
    tar = _copy(packed["tar"], tmp_path)
    _edit_manifest(tar, lambda m: m.pop("classes"))
    stream = ShardStream(str(tar), "train")
    assert stream.num_classes == 3 and stream.classes == ["0", "1", "2"]


def _write_map(root: Path, lines: list[str], split: str = "train") -> None:
    (root / f"{split}_map.txt").write_text("".join(f"{line}\n" for line in lines))
    (root / "manifest.json").unlink(missing_ok=True)


def test_a_zip_label_out_of_0_to_k_is_one_line_naming_its_line(packed, tmp_path):
    """A label of 10,000,000 built a 10-million-class head (5.7 GB)."""
    zipped = _copy(packed["zip"], tmp_path)
    lines = (zipped / "train_map.txt").read_text().splitlines()
    lines[5] = lines[5].rsplit("\t", 1)[0] + "\t10000000"
    _write_map(zipped, lines)
    with pytest.raises(
        DataError, match=r"train_map\.txt, line 6: label 10000000: its 4 distinct labels are not 0 \.\.\. 3"
    ):
        ZipImageDataset(str(zipped), "train")
    with pytest.raises(DataError, match=r"train_map\.txt, line 6: label 10000000: not one of the 5 classes"):
        ZipImageDataset(str(zipped), "train", num_classes=5)


def test_val_labels_beyond_the_training_classes_are_refused_before_training(packed, tmp_path):
    """They raised an IndexError in evaluate, after a whole training epoch."""
    zipped = _copy(packed["zip"], tmp_path)
    lines = (zipped / "val_map.txt").read_text().splitlines()
    lines[0] = lines[0].rsplit("\t", 1)[0] + "\t3"
    _write_map(zipped, lines, "val")
    assert len(ZipImageDataset(str(zipped), "train").classes) == 3
    with pytest.raises(DataError, match=r"val_map\.txt, line 1: label 3: not one of the 3 classes"):
        ZipImageDataset(str(zipped), "val", num_classes=3)  # what the builders pass: the training split's count


# 7. Silent acceptance: duplicates, counts that are wrong, shards cut short.
def test_a_member_listed_twice_is_one_line_naming_both_lines(packed, tmp_path):
    zipped = _copy(packed["zip"], tmp_path)
    lines = (zipped / "train_map.txt").read_text().splitlines()
    lines.append(lines[2].rsplit("\t", 1)[0] + "\t2")
    _write_map(zipped, lines)
    with pytest.raises(DataError, match=r"line 25: 'a/2\.png' is listed again, with another label \(line 3\)"):
        ZipImageDataset(str(zipped), "train")


def test_a_zip_count_that_differs_from_the_manifest_names_both(packed, tmp_path):
    zipped = _copy(packed["zip"], tmp_path)
    _edit_manifest(zipped, lambda m: m["files"]["train.zip"].update(images=25))
    with pytest.raises(DataError, match=r"train\.zip: its image list has 24 images, .*manifest\.json says 25"):
        ZipImageDataset(str(zipped), "train")


@pytest.mark.parametrize("delta", [-1, 1])
def test_a_shard_count_that_is_wrong_is_named_when_the_shard_is_read(packed, tmp_path, delta):
    tar = _copy(packed["tar"], tmp_path)
    manifest = json.loads((tar / "manifest.json").read_text())
    entry = manifest["files"]["val-000000.tar"]
    held = entry["images"]
    _edit_manifest(tar, lambda m: m["files"]["val-000000.tar"].pop("class_counts"))
    _edit_manifest(tar, lambda m: m["files"]["val-000000.tar"].update(images=held + delta))
    said = "more than " if delta < 0 else ""
    found = held if delta > 0 else held + delta + 1
    with pytest.raises(
        DataError, match=rf"val-000000\.tar holds {said}{found} samples, .*manifest\.json says {held + delta}"
    ):
        list(ShardStream(str(tar), "val", train=False))


def test_an_empty_shard_claimed_as_two_images_is_named(packed, tmp_path):
    tar = _copy(packed["tar"], tmp_path)
    import tarfile

    with tarfile.open(tar / "val-000000.tar", "w"):
        pass
    size = (tar / "val-000000.tar").stat().st_size
    _edit_manifest(tar, lambda m: m["files"]["val-000000.tar"].update(bytes=size, images=2, class_counts=[2, 0, 0]))
    with pytest.raises(DataError, match=r"val-000000\.tar holds 0 samples, .* says 2"):
        list(ShardStream(str(tar), "val", train=False))


def test_a_shard_cut_on_a_block_boundary_is_named(packed, tmp_path):
    """Without a manifest (nothing to compare its size to), its missing end-of-archive blocks tell."""
    tar = _copy(packed["tar"], tmp_path)
    (tar / "manifest.json").unlink()
    shard = tar / "train-000001.tar"
    data = shard.read_bytes()
    end = len(data.rstrip(b"\0"))
    shard.write_bytes(data[: (end + 511) // 512 * 512])  # every member whole, the end-of-archive blocks gone
    with pytest.raises(DataError, match=r"shard .*train-000001\.tar ends without the end-of-archive blocks"):
        ShardStream(str(tar), "train")


# 8. One line, not a traceback.
@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("a/0.png\t²\n", r"line 1: label '²' is not a class index"),
        (b"a/0.png\t0\n\xff\xfe\t1\n", r"line 2: not UTF-8 text \(invalid start byte at byte 0\)"),
    ],
    ids=["superscript_two", "not_utf8"],
)
def test_a_map_line_that_is_no_label_is_one_line(packed, tmp_path, content, message):
    zipped = _copy(packed["zip"], tmp_path)
    path = zipped / "train_map.txt"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    (zipped / "manifest.json").unlink()
    with pytest.raises(DataError, match=message):
        ZipImageDataset(str(zipped), "train")


def _patch_member(archive: Path, member: str, flag_bits: int | None = None, method: int | None = None) -> None:
    """Set a member's flag bits or compression method in both its local and its central header."""
    data = bytearray(archive.read_bytes())
    with zipfile.ZipFile(archive) as z:
        info = z.getinfo(member)
    name = member.encode()
    central = next(i for i in range(len(data)) if data[i : i + 4] == b"PK\x01\x02" and data[i + 46 :].startswith(name))
    for offset, (flags_at, method_at) in ((info.header_offset, (6, 8)), (central, (8, 10))):
        if flag_bits is not None:
            data[offset + flags_at : offset + flags_at + 2] = struct.pack("<H", flag_bits)
        if method is not None:
            data[offset + method_at : offset + method_at + 2] = struct.pack("<H", method)
    archive.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("patch", "message", "raw"),
    [
        ({"flag_bits": 1}, r"a/0\.png in .*train\.zip is encrypted", RuntimeError),
        ({"method": 99}, r"a/0\.png in .*train\.zip uses compression method 99", NotImplementedError),
    ],
    ids=["encrypted", "unknown_method"],
)
def test_an_unreadable_member_is_refused_from_the_directory(packed, tmp_path, patch, message, raw):
    zipped = _copy(packed["zip"], tmp_path)
    _patch_member(zipped / "train.zip", "a/0.png", **patch)
    (zipped / "manifest.json").unlink()
    with zipfile.ZipFile(zipped / "train.zip") as z, pytest.raises(raw):
        z.read("a/0.png")  # what the reader met mid-training
    with pytest.raises(DataError, match=message):
        ZipImageDataset(str(zipped), "train")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(classes=5), r"'classes' must be a list of class names, got 5"),
        (lambda m: m["files"].update({"train.zip": [1, 2]}), r"files\['train\.zip'\] must be an object, got \[1, 2\]"),
        (
            lambda m: m["files"]["train.zip"].update(images="abc"),
            r"files\['train\.zip'\]\.images must be a whole number",
        ),
        (
            lambda m: m["files"]["train.zip"].update(images=None),
            r"files\['train\.zip'\]\.images must be a whole number",
        ),
    ],
    ids=["classes_int", "entry_list", "images_str", "images_null"],
)
def test_a_manifest_field_of_the_wrong_type_is_one_line(packed, tmp_path, edit, message):
    zipped = _copy(packed["zip"], tmp_path)
    _edit_manifest(zipped, edit)
    with pytest.raises(DataError, match=rf"manifest\.json is not a dataset manifest \({message}"):
        ZipImageDataset(str(zipped), "train")


def test_a_cls_too_large_for_int64_is_one_line(tmp_path):
    from webdataset import TarWriter

    png = _png(np.random.default_rng(0))
    with TarWriter(str(tmp_path / "train-000000.tar"), encoder=False) as writer:
        writer.write({"__key__": "k0", "png": png, "cls": b"99999999999999999999999"})
    with pytest.raises(DataError, match=r"sample k0 in .*train-000000\.tar: label '99999999999999999999999' is not"):
        ShardStream(str(tmp_path), "train")


def test_a_tar_sample_of_many_fields_is_bounded_as_a_whole(tmp_path):
    """120 fields of 1 MB each passed ``data.max_image_mb=1.5``, which bounds each member: a sample is bounded too
    (here 12 fields of 0.4 MB)."""
    from webdataset import TarWriter

    png = _png(np.random.default_rng(0))
    with TarWriter(str(tmp_path / "train-000000.tar"), encoder=False) as writer:
        writer.write({"__key__": "k0", "png": png, "cls": b"0"})
        writer.write({"__key__": "k1", "png": png, "cls": b"0", **{f"x{i}": b"\0" * 400_000 for i in range(12)}})
    error = _within(30, lambda: list(shard_samples(str(tmp_path / "train-000000.tar"), 1_500_000)))
    _one_line(error, "sample k1 of", "fields of", "data.max_image_mb=1.5")


# 9. Stale shards, and messages that name the file.
def test_verify_names_a_stray_shard_the_trainer_refuses(packed, tmp_path, run_tool):
    tar = _copy(packed["tar"], tmp_path)
    shutil.copy(tar / "train-000000.tar", tar / "train-000099.tar")
    report = run_tool("pack_dataset", "--verify", str(tar), expect=1)
    assert f"{tar / 'train-000099.tar'}: not in {tar / 'manifest.json'} (a stray file" in report
    with pytest.raises(DataError, match=r"train-000099\.tar is not in .*manifest\.json"):
        ShardStream(str(tar), "train")


def test_verify_checks_each_shards_headers_against_the_manifest(packed, tmp_path, run_tool):
    tar = _copy(packed["tar"], tmp_path)
    assert run_tool("pack_dataset", "--verify", str(tar)).strip().endswith("ok")
    counts = json.loads((tar / "manifest.json").read_text())["files"]["val-000000.tar"]["class_counts"]
    assert counts != counts[::-1]
    _edit_manifest(tar, lambda m: m["files"]["val-000000.tar"].update(class_counts=counts[::-1]))
    report = run_tool("pack_dataset", "--verify", str(tar), expect=1)
    assert f"{tar / 'val-000000.tar'}: its labels do not match the manifest's class_counts" in report
    (tar / "manifest.json").unlink()  # a foreign set: the headers alone
    report = run_tool("pack_dataset", "--verify", str(tar))
    assert "(headers only: no manifest)" in report and report.strip().endswith("ok")


def test_whole_shards_scan_to_their_counts(packed):
    manifest = json.loads((packed["tar"] / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        found = scan_shard(str(packed["tar"] / name), 1 << 20)
        assert found["images"] == entry["images"]
        assert [found["labels"].get(i, 0) for i in range(3)] == entry["class_counts"]
