#!/usr/bin/env python
"""What a dataset's bookkeeping costs as it grows: index build time, time to the first batch, and the memory of
the rank and of each loader worker, per format, at each ``--scale`` (images), extrapolated to a node.

It makes ``N`` tiny JPEGs in ``--classes`` class folders (hard links to a few distinct files: what is measured is
the index, not the decoder), packs them with ``tools/pack_dataset.py`` (zip, and tar shards), and measures each
row in a fresh process, as rank 0 of ``--world``:

* ``folder``, ``zip/no``, ``zip/part``, ``tar``: cat's readers (``data.format``; ``part`` holds the rank's share),
  with the index kept in a fresh run folder (built: ``build_s``), then opened in another process (forked before
  the loader starts) as the node's other ranks open it (mapped: ``other_rank_s``, ``other_rank_mb``);
* ``torchvision``, ``timm``: torchvision's ``ImageFolder`` and timm's ``create_dataset`` on the same folder.

Then a DataLoader of ``--workers`` forked workers reads the rank's epoch (``DistributedSampler``, or the zip's
``RankShardSampler`` under ``part``). Reported: ``first_batch_s`` (dataset built to first batch), the private
memory the dataset adds to the rank that built it (``builder_mb``) and to another (a cache's bytes apart: they
are the images; the index file's pages are the page cache's, counted once per node in ``index_file_mb``), each
worker's private memory after ``--k`` batches and at the epoch's end (``worker_k_mb``, ``worker_end_mb``: unique
set size, the largest worker's), and its growth over the epoch. With two or more scales,
the slopes between the two largest give bytes per image per process, and a node of ``--node-ranks`` ranks x
``--workers-per-rank`` workers on ``--node-images`` images is extrapolated from them:
``node_gb = images x (builder + (ranks - 1) x other rank + ranks x workers x worker end + index file)`` slopes.

    python tools/bench_index.py --scale 10000 100000 --data /tmp/bench_index           # the tests' quick look
    python tools/bench_index.py --scale 100000 1000000 --data /scratch/bench_index --json   # docs/perf.md
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from cat.runtime.memory import private_memory
from cat.toolkit import positive_int

FORMATS = ("folder", "zip/no", "zip/part", "tar", "torchvision", "timm")
_MB = 1e6


def children() -> list[int]:
    """This process's child processes (its loader workers)."""
    found = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with open(path) as f:
            found += [int(pid) for pid in f.read().split()]
    return found


def workers_private() -> dict[int, int]:
    """Each live loader worker's private bytes (a worker whose stream ended may be gone)."""
    found = {}
    for pid in children():
        with contextlib.suppress(OSError):
            found[pid] = private_memory(pid)["private"]
    return found


def make_folder(root: Path, images: int, classes: int) -> None:
    """``root/train/<class>/<class>_<i>.JPEG``: hard links to 64 distinct 8x8 JPEGs (a file has at most 65,000)."""
    pool = root / "pool"
    pool.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    sources = []
    for i in range(64):
        path = pool / f"{i}.JPEG"
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(path, quality=90)
        sources.append(str(path))
    for c in range(classes):
        (root / "train" / f"n{c:08d}").mkdir(parents=True, exist_ok=True)
    for i in range(images):
        c = i % classes
        os.link(sources[i % 64], root / "train" / f"n{c:08d}" / f"n{c:08d}_{i}.JPEG")


def prepare(data: Path, images: int, classes: int, shard_mb: float, packs: tuple[str, ...] = ("zip", "tar")) -> Path:
    """The folder, and the ``packs`` (zip, tar) copies, of ``images`` tiny images under ``data/<images>`` (made once,
    then reused)."""
    root = data / str(images)
    if not (root / "folder" / ".complete").is_file():
        started = time.perf_counter()
        make_folder(root / "folder", images, classes)
        (root / "folder" / ".complete").write_text("")
        print(f"made {images} images in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    pack = runpy.run_path(str(Path(__file__).with_name("pack_dataset.py")))["main"]
    with contextlib.redirect_stdout(sys.stderr):
        for fmt, extra in (("zip", []), ("tar", ["--shard-mb", str(shard_mb)])):
            if fmt in packs and not (root / fmt / "manifest.json").is_file():
                pack([str(root / "folder"), str(root / fmt), "--splits", "train", "--format", fmt, *extra])
    return root


def _to_tensor(image: Image.Image) -> Any:
    import torchvision.transforms.functional as F

    return F.pil_to_tensor(image)


def _dataset(fmt: str, root: Path, world: int, batch: int, run: str | None) -> Any:
    """The format's dataset as rank 0 of ``world``, its images turned into tensors and nothing more."""
    from cat.data import AugConfig, DataConfig, build_dataset
    from cat.data.packed import ZipImageDataset
    from cat.data.shards import ShardStream

    folder = str(root / "folder" / "train")
    if fmt == "torchvision":
        from torchvision.datasets import ImageFolder

        return ImageFolder(folder, transform=_to_tensor)
    if fmt == "timm":
        from timm.data import create_dataset

        return create_dataset("", root=folder, split="train", transform=_to_tensor)
    if fmt == "tar":
        return ShardStream(str(root / "tar"), "train", _to_tensor, world=world, batch_size=batch, index_dir=run)
    if fmt.startswith("zip"):
        mode = fmt.split("/")[1]
        return ZipImageDataset(str(root / "zip"), "train", _to_tensor, mode, rank=0, world=world, index_dir=run)
    data = DataConfig(
        name="folder",
        root=str(root / "folder"),
        format="folder",
        num_classes=None,
        train_split="train",
        val_split="val",
        img_size=8,
        max_image_mb=64.0,
        decode_draft=False,
        normalize_on_device=False,
        interpolation="bilinear",
        mean=[0.5] * 3,
        std=[0.5] * 3,
        crop_pct=1.0,
    )
    aug = AugConfig(auto_augment=None, color_jitter=None, hflip=0.0, reprob=0.0, remode="pixel", recount=1)
    dataset = build_dataset(data, aug, "train", 0, world, batch, 0, None, run)  # what train_cls.py builds
    dataset.transform, dataset.loader = _to_tensor, _open_rgb
    return dataset


def _open_rgb(path: str) -> Image.Image:
    with Image.open(path) as image:
        return image.convert("RGB")


def _cat_reader(fmt: str) -> bool:
    return fmt not in ("torchvision", "timm")


def measure_rank(fmt: str, root: Path, world: int, batch: int, run: str | None) -> dict[str, Any]:
    """The dataset of a rank that finds the index already built (cat's readers), timed, and the private memory
    it adds (the index's mapped pages are the page cache's, counted once per node)."""
    from cat.data.index import return_freed_memory

    return_freed_memory()  # a forked rank starts from its parent's heap: what the parent freed is not this rank's
    before = private_memory()["anonymous"]
    started = time.perf_counter()
    dataset = _dataset(fmt, root, world, batch, run)
    seconds = time.perf_counter() - started
    held = getattr(dataset, "cached_bytes", lambda: 0)()
    return {"other_rank_s": seconds, "other_rank_mb": (private_memory()["anonymous"] - before - held) / _MB}


def _other_rank(send: Any, fmt: str, root: Path, world: int, batch: int, run: str) -> None:
    send.send(measure_rank(fmt, root, world, batch, run))


def measure_row(fmt: str, root: Path, world: int, batch: int, workers: int, k: int) -> dict[str, Any]:
    """One format's row: its builder rank and loader measured in this (fresh) process, another rank in a second."""
    from torch.utils.data import DataLoader, DistributedSampler

    from cat.data.packed import RankShardSampler

    with tempfile.TemporaryDirectory() as run:
        before = private_memory()["anonymous"]
        started = time.perf_counter()
        dataset = _dataset(fmt, root, world, batch, run if _cat_reader(fmt) else None)
        build_s = time.perf_counter() - started
        held = getattr(dataset, "cached_bytes", lambda: 0)()
        builder_bytes = private_memory()["anonymous"] - before - held
        index_file = sum(os.path.getsize(p) for p in glob.glob(os.path.join(run, ".index-*.bin")))
        if fmt == "tar":
            sampler = None
        elif fmt == "zip/part":
            sampler = RankShardSampler(len(dataset), 0, world)
        else:
            sampler = DistributedSampler(dataset, num_replicas=world, rank=0, shuffle=True, seed=0, drop_last=True)
        loader = DataLoader(
            dataset,
            batch_size=batch,
            sampler=sampler,
            num_workers=workers,
            drop_last=True,
            multiprocessing_context="fork",
        )
        batches = len(loader)
        iterator = iter(loader)
        next(iterator)
        first_batch_s = time.perf_counter() - started
        at_k: dict[int, int] = {}
        for step in range(1, batches):
            next(iterator)
            if step == min(k, batches - 1):
                at_k = workers_private()
        at_end = workers_private()
        del iterator
        other = {"other_rank_s": build_s, "other_rank_mb": builder_bytes / _MB}  # without an index: each rank builds
        if _cat_reader(fmt):  # another rank: a process with the same imports, its own memory, the index built
            context = multiprocessing.get_context("fork")
            receive, send = context.Pipe(duplex=False)
            rank = context.Process(target=_other_rank, args=(send, fmt, root, world, batch, run))
            rank.start()
            other = receive.recv()
            rank.join()
    return {
        "format": fmt,
        "images": len(dataset) if fmt != "tar" else sum(dataset.counts),
        "build_s": build_s,
        "first_batch_s": first_batch_s,
        "builder_mb": builder_bytes / _MB,
        **other,
        "cache_mb": held / _MB,
        "index_file_mb": index_file / _MB,
        "worker_k_mb": max(at_k.values()) / _MB,
        "worker_end_mb": max(at_end.values(), default=0) / _MB,
        "worker_growth_mb": max((at_end[pid] - at_k[pid] for pid in at_end.keys() & at_k.keys()), default=0) / _MB,
        "epoch_batches": batches,
    }


def extrapolate(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per format, bytes per image per process between the two largest scales, and the node they add up to: one
    builder rank, the other ranks mapping its index, each rank's workers, and the index file once."""
    out = []
    for fmt in args.formats:
        small, large = sorted((r for r in rows if r["format"] == fmt), key=lambda r: r["images"])[-2:]
        span = large["images"] - small["images"]

        def slope(field: str, small: dict = small, large: dict = large, span: int = span) -> float:
            return max(0.0, (large[field] - small[field]) * _MB / span)

        per_image = {
            "builder": slope("builder_mb"),
            "other_rank": slope("other_rank_mb"),
            "worker": slope("worker_end_mb"),
            "index_file": slope("index_file_mb"),
        }
        ranks, workers = args.node_ranks, args.node_ranks * args.workers_per_rank
        node = per_image["builder"] + (ranks - 1) * per_image["other_rank"] + workers * per_image["worker"]
        node += per_image["index_file"]
        out.append({"format": fmt, **{f"{k}_bytes_per_image": v for k, v in per_image.items()}})
        out[-1]["node_gb"] = args.node_images * node / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=positive_int, nargs="+", default=[10000, 100000], help="images per run")
    parser.add_argument("--classes", type=positive_int, default=1000)
    parser.add_argument("--data", type=Path, default=None, help="where the generated sets are kept (default: temp)")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--world", type=positive_int, default=8, help="ranks: each row is rank 0 of them")
    parser.add_argument("--workers", type=positive_int, default=2, help="loader workers of the measured rank")
    parser.add_argument("--batch", type=positive_int, default=64)
    parser.add_argument("--k", type=positive_int, default=10, help="the batch after which workers are first measured")
    parser.add_argument("--shard-mb", type=float, default=64.0, help="tar: megabytes per shard")
    parser.add_argument("--node-images", type=positive_int, default=1_281_167)
    parser.add_argument("--node-ranks", type=positive_int, default=8)
    parser.add_argument("--workers-per-rank", type=positive_int, default=8)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # FORMAT:ROOT: one row, in this (fresh) process
    args = parser.parse_args(argv)
    if args.measure:
        fmt, root = args.measure.split(":", 1)
        print(json.dumps(measure_row(fmt, Path(root), args.world, args.batch, args.workers, args.k)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or Path(tmp)
        for images in sorted(args.scale):
            packs = tuple(p for p in ("zip", "tar") if any(f.startswith(p) for f in args.formats))
            root = prepare(data, images, args.classes, args.shard_mb, packs)
            for fmt in args.formats:
                command = [sys.executable, __file__, "--measure", f"{fmt}:{root}", "--world", str(args.world)]
                command += ["--workers", str(args.workers), "--batch", str(args.batch), "--k", str(args.k)]
                done = subprocess.run(command, check=True, capture_output=True, text=True)
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"{images} {fmt}: {rows[-1]}", file=sys.stderr)
    node = extrapolate(rows, args) if len(args.scale) > 1 else []
    if args.json:
        print(json.dumps({"rows": rows, "node": node}, indent=2))
        return 0
    print(
        f"rank 0 of {args.world}, {args.workers} workers, batch {args.batch}; memory: MB private to the process "
        "(a cache's bytes apart)"
    )
    columns = {
        "build s": "build_s",
        "other rank s": "other_rank_s",
        "1st batch s": "first_batch_s",
        "builder": "builder_mb",
        "other rank": "other_rank_mb",
        "cache": "cache_mb",
        "index file": "index_file_mb",
        "worker@k": "worker_k_mb",
        "worker end": "worker_end_mb",
        "growth": "worker_growth_mb",
    }
    print(f"{'images':>9} {'format':<12}" + "".join(f" {name:>12}" for name in columns))
    for r in rows:
        print(f"{r['images']:>9} {r['format']:<12}" + "".join(f" {r[field]:>12.2f}" for field in columns.values()))
    if node:
        print(
            f"\nper image between the two largest scales; a node of {args.node_ranks} ranks x {args.workers_per_rank} "
            f"workers on {args.node_images} images:"
        )
        for n in node:
            print(
                f"  {n['format']:<12} builder {n['builder_bytes_per_image']:6.1f} B, other rank "
                f"{n['other_rank_bytes_per_image']:6.1f} B, worker {n['worker_bytes_per_image']:6.1f} B, index file "
                f"{n['index_file_bytes_per_image']:5.1f} B -> node {n['node_gb']:.2f} GB"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
