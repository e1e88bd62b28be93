"""The compact index (cat.data.index): built once and mapped by the rest, no copy in a forked worker, a stale or
altered file rebuilt or refused, and the same samples in the same order as torchvision's ImageFolder."""

from __future__ import annotations

import gc
import hashlib
import io
import json
import logging
import multiprocessing
import os
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets.folder import make_dataset

from cat.data import ZipImageDataset, build_dataset
from cat.data.index import MAGIC, index_path
from cat.errors import DataError, OutputError
from cat.runtime.memory import private_memory
from cat.runtime.seal import seal
from tests.conftest import compose_config

_FORK = multiprocessing.get_context("fork")


def _tiny_jpeg(seed: int = 0) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(out, "JPEG")
    return out.getvalue()


def _zip_split(root: Path, images: int, classes: int = 100) -> Path:
    """``root/train.zip`` + ``train_map.txt``: ``images`` tiny JPEGs, stored as the packer stores them."""
    root.mkdir(parents=True, exist_ok=True)
    data = _tiny_jpeg()
    members = [f"n{i % classes:04d}/{i}.jpg" for i in range(images)]
    with zipfile.ZipFile(root / "train.zip", "w", zipfile.ZIP_STORED) as z:
        for member in members:
            z.writestr(member, data)
    (root / "train_map.txt").write_text("".join(f"{m}\t{i % classes}\n" for i, m in enumerate(members)))
    return root


def _folder(root: Path, images: int, classes: int = 10) -> Path:
    """``root/train/<class>/*.jpg``: hard links to a few tiny JPEGs (a file has at most 65,000 links)."""
    root.mkdir(parents=True, exist_ok=True)
    sources = [root / f"{i}.jpg" for i in range(-(-images // 50_000))]
    for i, source in enumerate(sources):
        source.write_bytes(_tiny_jpeg(i))
    for c in range(classes):
        (root / "train" / f"c{c:03d}").mkdir(parents=True)
    for i in range(images):
        os.link(sources[i % len(sources)], root / "train" / f"c{i % classes:03d}" / f"{i}.jpg")
    return root


def _folder_config(root: Path):
    return compose_config("cls", "data=folder", f"data.root={root}", "data.img_size=8", "aug=none")


def _private_now(batch: list) -> int:
    return private_memory()["private"]


def _worker_growth(dataset, batch_size: int = 5000) -> int:
    """How much a forked loader worker's private memory grows from its start to after its last batch, having
    fetched every sample (each batch reports the worker's private bytes: the collate function runs there)."""
    start = _FORK.Value("q", 0)

    def at_start(_: int) -> None:
        start.value = private_memory()["private"]

    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=1,
        worker_init_fn=at_start,
        collate_fn=_private_now,
        multiprocessing_context=_FORK,
    )
    # What this test process holds (what earlier tests left in the pytest worker) out of the loader worker's garbage
    # collections, whose walks wrote to its pages (10 MB in one run): the growth is then what reading writes to.
    gc.collect()
    gc.freeze()
    return list(loader)[-1] - start.value


class _MemberBytes(Dataset):
    """A zip split's members as their byte counts: each read from the zip as loading does, none decoded."""

    def __init__(self, dataset: ZipImageDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> int:
        return len(self.dataset._read(index))


# A worker copied the zip's directory (~170 MB at 200k members) or the folder's (path, label) pairs (~30 MB).
_WORKER_GROWTH_BOUND = 8 << 20


def test_a_forked_worker_reading_every_member_of_a_200k_zip_copies_no_bookkeeping(tmp_path):
    root = _zip_split(tmp_path / "zip", 200_000)
    dataset = ZipImageDataset(str(root), "train", index_dir=str(tmp_path / "run"))
    growth = _worker_growth(_MemberBytes(dataset))
    assert growth < _WORKER_GROWTH_BOUND, f"a worker's private memory grew by {growth / 1e6:.1f} MB"


def test_a_forked_worker_loading_every_path_of_a_200k_folder_copies_no_bookkeeping(tmp_path):
    root = _folder(tmp_path / "folder", 200_000, classes=100)
    cfg = _folder_config(root)
    dataset = build_dataset(cfg.data, cfg.aug, "train", index_dir=str(tmp_path / "run"))
    dataset.transform, dataset.loader = None, len  # every sample's path made; no file opened
    growth = _worker_growth(dataset)
    assert growth < _WORKER_GROWTH_BOUND, f"a worker's private memory grew by {growth / 1e6:.1f} MB"


def _rank(root: str, run: str, go, results) -> None:
    """A rank of a node: waits for the others, builds its dataset, reports what the index log said."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("cat.data").addHandler(handler)
    logging.getLogger("cat.data").setLevel(logging.INFO)
    go.wait()
    dataset = ZipImageDataset(root, "train", index_dir=run)
    results.put((len(dataset), [line.split(" the index")[0] for line in said if "the index of" in line]))


def test_the_ranks_of_a_node_build_the_index_once_and_read_it(tmp_path):
    root = str(_zip_split(tmp_path / "zip", 5000))
    go, results = _FORK.Barrier(4), _FORK.Queue()
    ranks = [_FORK.Process(target=_rank, args=(root, str(tmp_path / "run"), go, results)) for _ in range(4)]
    for rank in ranks:
        rank.start()
    said = [results.get(timeout=120) for _ in ranks]
    for rank in ranks:
        rank.join(30)
    assert all(count == 5000 for count, _ in said)
    assert sorted(line for _, lines in said for line in lines) == ["built", "read", "read", "read"]


def _one_rank_log(caplog, build):
    caplog.clear()
    logging.getLogger("cat.data").addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="cat.data"):
            result = build()
    finally:
        logging.getLogger("cat.data").removeHandler(caplog.handler)
    return result, " ".join(r.getMessage() for r in caplog.records if "the index of" in r.getMessage())


def test_a_changed_folder_rebuilds_its_index(tmp_path, caplog):
    root = _folder(tmp_path / "folder", 30, classes=3)
    cfg, run = _folder_config(root), str(tmp_path / "run")
    first, said = _one_rank_log(caplog, lambda: build_dataset(cfg.data, cfg.aug, "train", index_dir=run))
    assert len(first) == 30 and said.startswith("built")
    again, said = _one_rank_log(caplog, lambda: build_dataset(cfg.data, cfg.aug, "train", index_dir=run))
    assert len(again) == 30 and said.startswith("read")
    os.link(root / "0.jpg", root / "train" / "c001" / "new.jpg")  # a file added: its class folder changed
    (root / "train" / "c002" / "deep").mkdir()
    changed, said = _one_rank_log(caplog, lambda: build_dataset(cfg.data, cfg.aug, "train", index_dir=run))
    assert len(changed) == 31 and "built" in said and "the dataset changed" in said
    assert changed.samples[changed.samples.index((str(root / "train" / "c001" / "new.jpg"), 1))][1] == 1
    os.link(root / "0.jpg", root / "train" / "c002" / "deep" / "x.jpg")  # a subfolder changed, not the class's
    deeper, said = _one_rank_log(caplog, lambda: build_dataset(cfg.data, cfg.aug, "train", index_dir=run))
    assert len(deeper) == 32 and "c002/deep changed" in said
    # A file swapped in and its folder's modification time set back: the change time still moves.
    for folder in (root / "train" / "c000", root / "train" / "c002" / "deep"):
        times = os.stat(folder)
        os.link(root / "0.jpg", folder / "swapped.jpg")
        os.utime(folder, ns=(times.st_atime_ns, times.st_mtime_ns))
        swapped, said = _one_rank_log(caplog, lambda: build_dataset(cfg.data, cfg.aug, "train", index_dir=run))
        assert str(folder / "swapped.jpg") in [path for path, _ in swapped.samples] and "built" in said, said


def _header(path: str) -> tuple[dict, int]:
    data = Path(path).read_bytes()
    _, _, length = struct.unpack_from("<8sII", data)
    return json.loads(data[16 : 16 + length]), length


def _rewrite_header(path: str, header: dict, sealed: bool = True) -> None:
    """The index with another header, its arrays moved along (their offsets count from the body's start); sealed
    by this user's key (what cat checks past the seal), or with the seal it had (what anyone else can write)."""
    data = Path(path).read_bytes()
    _, length = _header(path)
    if sealed:
        header = {
            **{k: v for k, v in header.items() if k != "seal"},
            "seal": seal({k: v for k, v in header.items() if k != "seal"}),
        }
    text = json.dumps(header).encode()
    body = data[-(-(16 + length) // 64) * 64 :]
    start = -(-(16 + len(text)) // 64) * 64
    Path(path).write_bytes(struct.pack("<8sII", MAGIC, 1, len(text)) + text.ljust(start - 16, b"\0") + body)


def test_an_altered_or_torn_index_is_rebuilt(tmp_path, caplog):
    root = _zip_split(tmp_path / "zip", 300, classes=3)
    run = str(tmp_path / "run")
    reference = ZipImageDataset(str(root), "train", index_dir=run)
    path = index_path(run, "zip", str(root / "train.zip"))
    pristine = Path(path).read_bytes()
    flipped = bytearray(pristine)
    flipped[-100] ^= 0xFF  # a byte of the arrays
    header, _ = _header(path)
    past_end = json.loads(json.dumps(header))
    past_end["arrays"]["labels"][2] = 1 << 40
    wrong_dtype = json.loads(json.dumps(header))
    wrong_dtype["arrays"]["labels"][0] = "<f8"
    # Labels moved one class on and the checksum recomputed, by someone without this user's key.
    labels_at = -(-(16 + _header(path)[1]) // 64) * 64 + header["arrays"]["labels"][2]
    relabelled = bytearray(pristine)
    count = header["arrays"]["labels"][1]
    labels = np.frombuffer(pristine, "<i4", count, labels_at)
    relabelled[labels_at : labels_at + 4 * count] = ((labels + 1) % 3).astype("<i4").tobytes()
    forged = json.loads(json.dumps(header))
    digest = hashlib.sha256()
    for dtype, length, offset in forged["arrays"].values():
        start = labels_at - header["arrays"]["labels"][2] + offset
        digest.update(bytes(relabelled[start : start + length * np.dtype(dtype).itemsize]))
    forged["sha256"] = digest.hexdigest()
    _rewrite_header(path, header)  # the helper itself keeps a valid index valid
    assert "read" in _one_rank_log(caplog, lambda: ZipImageDataset(str(root), "train", index_dir=run))[1]
    cases = {
        "its arrays do not match their checksum": lambda: Path(path).write_bytes(bytes(flipped)),
        "runs past the file's end": lambda: _rewrite_header(path, past_end),
        "expected dtype <i4": lambda: _rewrite_header(path, wrong_dtype),
        "not a version-1 cat index": lambda: Path(path).write_bytes(b"NOTINDEX" + pristine[8:]),
        "its seal does not hold": lambda: (
            Path(path).write_bytes(bytes(relabelled)),
            _rewrite_header(path, forged, sealed=False),
        ),
        "shorter than its preamble": lambda: Path(path).write_bytes(MAGIC),
    }
    for why, alter in cases.items():
        Path(path).write_bytes(pristine)
        alter()
        rebuilt, said = _one_rank_log(caplog, lambda: ZipImageDataset(str(root), "train", index_dir=run))
        assert "built" in said and why in said, (why, said)
        assert rebuilt.targets.tolist() == reference.targets.tolist() and rebuilt.member(7) == reference.member(7)
        assert Path(path).read_bytes() == pristine
    for plant, kind in (
        (lambda: os.symlink(tmp_path / "elsewhere", path), "symbolic link"),
        (lambda: os.mkfifo(path), "FIFO"),
    ):
        os.remove(path)
        plant()  # planted at the index's name: refused by name, not followed, not blocked on, not replaced
        with pytest.raises(OutputError, match=kind):
            ZipImageDataset(str(root), "train", index_dir=run)
        assert not os.path.exists(tmp_path / "elsewhere")


def test_an_index_altered_with_its_checksum_fixed_is_still_checked(tmp_path):
    """Someone who rewrites the arrays and their checksum gets no path out of the dataset's folder and no read
    outside the zip: the readers check what the arrays mean, however the index came about."""
    from cat.data.index import load_index, save_index

    root = _folder(tmp_path / "folder", 20, classes=2)
    cfg, run = _folder_config(root), str(tmp_path / "run")
    build_dataset(cfg.data, cfg.aug, "train", index_dir=run)
    path = index_path(run, "folder", str(root / "train"))
    index = load_index(path, "folder", _header(path)[0]["key"])
    names = [b"../../../etc/passwd" if i == 3 else index.name(i) for i in range(len(index))]
    offsets = np.zeros(len(names) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(n) for n in names])
    forged = type(index)(index.kind, index.key, index.meta, {**index.arrays, "name_offsets": offsets})
    forged.arrays["names"] = np.frombuffer(b"".join(names), dtype=np.uint8)
    save_index(forged, path)
    with pytest.raises(DataError, match=r"sample 3 is named b'../../../etc/passwd': an altered index"):
        build_dataset(cfg.data, cfg.aug, "train", index_dir=run)

    # A link planted in a class folder to an image outside the root (the listing leaves it out), named by an index
    # forged for the folder as it is now and sealed: the reader resolves each path and opens it only inside data.root.
    outside = tmp_path / "outside.png"
    Image.new("RGB", (8, 8), (255, 0, 0)).save(outside)
    first = index.labels.tolist().index(0)
    (root / "train" / "c000" / "evil.png").symlink_to(outside)
    build_dataset(cfg.data, cfg.aug, "train", index_dir=run)
    index = load_index(path, "folder", _header(path)[0]["key"])
    names = [b"evil.png" if i == first else index.name(i) for i in range(len(index))]
    offsets = np.zeros(len(names) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(n) for n in names])
    forged = type(index)(index.kind, index.key, index.meta, {**index.arrays, "name_offsets": offsets})
    forged.arrays["names"] = np.frombuffer(b"".join(names), dtype=np.uint8)
    save_index(forged, path)
    dataset = build_dataset(cfg.data, cfg.aug, "train", index_dir=run)
    assert dataset.index.name(first) == b"evil.png"  # the forged index was taken: its key and checksum hold
    with pytest.raises(DataError, match=r"evil\.png leads out of .* \(to .*outside\.png\): only files inside data"):
        dataset[first]

    zipped = _zip_split(tmp_path / "zip", 50, classes=5)
    ZipImageDataset(str(zipped), "train", index_dir=run)
    path = index_path(run, "zip", str(zipped / "train.zip"))
    index = load_index(path, "zip", _header(path)[0]["key"])
    offsets = index.arrays["header_offsets"].copy()
    offsets[4] = 1 << 40
    save_index(type(index)(index.kind, index.key, index.meta, {**index.arrays, "header_offsets": offsets}), path)
    with pytest.raises(DataError, match=r"n0004/4\.jpg in .*train\.zip lies past the file's end"):
        ZipImageDataset(str(zipped), "train", index_dir=run)


def test_the_folder_listing_is_imagefolders_order(tmp_path):
    """Nested folders whose names sort around the path separator ('sub-a' < 'sub/x' < 'sub2'), upper-case
    extensions and files that are no images: the same (path, label) list as torchvision's make_dataset."""
    train = tmp_path / "train"
    layout = ["b/z.JPG", "b/a.png", "b/sub/x.jpg", "b/sub-a/y.jpeg", "b/sub2/w.jpg", "b/sub/deeper/v.webp", "a/1.jpg"]
    layout += ["a/notes.txt", "a/Ä.jpg", "c/only.PNG"]
    for relative in layout:
        (train / relative).parent.mkdir(parents=True, exist_ok=True)
        (train / relative).write_bytes(b"")
    cfg = _folder_config(tmp_path)
    dataset = build_dataset(cfg.data, cfg.aug, "train")
    expected = make_dataset(str(train), {"a": 0, "b": 1, "c": 2}, extensions=(".jpg", ".jpeg", ".png", ".webp"))
    assert list(dataset.samples) == expected and dataset.targets.tolist() == [label for _, label in expected]


def _read_every_sample_after(dataset, change) -> None:
    change()
    for i in range(len(dataset)):
        dataset.index.name(i), int(dataset.index.labels[i])


@pytest.mark.parametrize("change", ["truncate", "rewrite"])
def test_an_index_file_truncated_or_rewritten_under_a_run_cannot_kill_it(tmp_path, change):
    """The index a run read stays whole in its memory when its file is truncated (a mapped one ended the process by
    SIGBUS, rc 135, without a word in the console or log.txt) or rewritten with other content."""
    root = _zip_split(tmp_path / "zip", 5000)
    dataset = ZipImageDataset(str(root), "train", index_dir=str(tmp_path / "run"))
    (path,) = (tmp_path / "run").glob(".index-*.bin")
    expected = [dataset.index.name(i) for i in range(0, len(dataset), 499)]

    def alter() -> None:
        with open(path, "r+b") as file:
            file.truncate(64) if change == "truncate" else file.write(b"\xff" * path.stat().st_size)

    reader = _FORK.Process(target=_read_every_sample_after, args=(dataset, alter))
    reader.start()
    reader.join(60)
    assert reader.exitcode == 0, f"the reader ended with {reader.exitcode} (-7: SIGBUS)"
    assert [dataset.index.name(i) for i in range(0, len(dataset), 499)] == expected


def test_a_kept_zip_index_is_checked_against_its_image_list(tmp_path):
    """The image list rewritten with the same size and modification time (labels moved one class on), and an
    index whose labels were flipped with its checksum recomputed: each run trains on the list's labels."""
    from cat.data.index import load_index, save_index

    zipped, run = _zip_split(tmp_path / "zip", 40, classes=4), str(tmp_path / "run")
    listed = ZipImageDataset(str(zipped), "train", index_dir=run)
    assert listed.index.labels.tolist() == [i % 4 for i in range(40)]
    map_path = zipped / "train_map.txt"
    times = os.stat(map_path)
    lines = map_path.read_text().splitlines()
    map_path.write_text("".join(f"{line[:-1]}{(int(line[-1]) + 1) % 4}\n" for line in lines))  # same size
    os.utime(map_path, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert (os.stat(map_path).st_size, os.stat(map_path).st_mtime_ns) == (times.st_size, times.st_mtime_ns)
    moved = [(i + 1) % 4 for i in range(40)]
    assert ZipImageDataset(str(zipped), "train", index_dir=run).index.labels.tolist() == moved

    path = index_path(run, "zip", str(zipped / "train.zip"))
    index = load_index(path, "zip", _header(path)[0]["key"])
    flipped = (3 - index.labels).astype(index.labels.dtype)
    save_index(type(index)(index.kind, index.key, index.meta, {**index.arrays, "labels": flipped}), path)
    assert load_index(path, "zip", _header(path)[0]["key"]).labels.tolist() != moved  # the forgery holds as a file
    assert ZipImageDataset(str(zipped), "train", index_dir=run).index.labels.tolist() == moved
