#!/usr/bin/env python
"""The training input pipeline's speed per format, side by side in one run (medians of rounds).

It first makes an ImageNet-like JPEG set of its own (``--images`` images in ``--classes`` classes;
sides, aspect ratios and JPEG qualities drawn around ImageNet train's: ~400x350 on average, quality
75-95, ~100 KB a file) and packs it (``tools/pack_dataset.py``'s zip layout). Then, for each format,
the DeiT training transform at 224 through a DataLoader of ``--workers`` worker processes:

* ``folder``            cat's ImageFolder reader (``data.format=folder``);
* ``folder/draft``      the same with ``data.decode_draft=true``: each JPEG decoded at the least scale its
  random crop allows (the crops timm draws);
* ``zip/max-side``      the zip reader on a copy packed with ``--max-side`` (default 256): smaller images stored;
* ``zip/max-side/uint8`` the same with ``data.normalize_on_device=true``: the loader stops at uint8 images (the
  float conversion, normalisation and random erasing run on the training device, not timed here, as timm's
  prefetcher does);
* ``zip/no``, ``zip/part``, ``zip/full``  the zip reader under each ``data.cache_mode``
  (``part`` as rank 0 of ``--world`` ranks: it holds and samples 1/world of the images);
* ``tar``               the webdataset shard stream (``data.format=tar``) as rank 0 of ``--world``,
  shards of ``--shard-mb``;
* ``timm``              timm's own loader (``create_dataset`` + ``create_loader``) on the folder, the anchor.

It reports images/s per worker process, files opened per epoch (an untimed pass over the rank's
epoch in a fresh copy of the dataset, as a worker process starts, counting ``open`` calls with an
audit hook; for tar beside the shards the rank's span of the epoch touches) and each rank's cache
memory (the bytes the reader holds; on ImageNet-1K train, ~140 GB
of JPEGs, ``part`` on 8 ranks holds ~17.5 GB per rank and ``full`` all of it).

    python tools/bench_data.py                        # 2,000 images, 100 classes, 1 worker
    python tools/bench_data.py --images 4000 --workers 4 --world 8 --json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import pickle
import runpy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset

from cat.data import AugConfig, DataConfig, build_transform
from cat.data.images import build_decoding
from cat.data.manifest import read_manifest
from cat.data.packed import RankShardSampler, ZipImageDataset
from cat.data.shards import ShardStream
from cat.toolkit import non_negative_int, positive_int

FORMATS = (
    "folder",
    "folder/draft",
    "zip/no",
    "zip/max-side",
    "zip/max-side/uint8",
    "zip/part",
    "zip/full",
    "tar",
    "timm",
)
_OPENED = [0]  # dataset files opened in this process since the audit hook went in
_COUNTED_UNDER: list[str] = []  # the data folder: opens elsewhere (Python's own imports) do not count


def make_imagenet_like(root: Path, images: int, classes: int, seed: int = 0) -> None:
    """``root/train/<class>/*.JPEG``: smooth colour fields with texture, ImageNet-like sizes and qualities."""
    rng = np.random.default_rng(seed)
    for i in range(images):
        folder = root / "train" / f"n{i % classes:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        short = int(np.clip(rng.normal(360, 60), 150, 600))
        aspect = float(np.clip(rng.lognormal(np.log(1.25), 0.2), 0.6, 2.2))
        w, h = (int(short * aspect), short) if rng.random() < 0.8 else (short, int(short * aspect))
        coarse = rng.integers(0, 256, (max(2, h // 32), max(2, w // 32), 3), dtype=np.uint8)
        image = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC), dtype=np.int16)
        image += rng.integers(-24, 25, (h, w, 3), dtype=np.int16)  # texture: ImageNet-like file sizes
        quality = int(rng.integers(75, 96))
        Image.fromarray(image.clip(0, 255).astype(np.uint8)).save(folder / f"img_{i:06d}.JPEG", quality=quality)


def _data_config(decode_draft: bool = False, normalize_on_device: bool = False) -> DataConfig:
    """The ImageNet evaluation and DeiT training settings of the data section that the transform reads."""
    return DataConfig(
        img_size=224,
        interpolation="bicubic",
        mean=[0.485, 0.456, 0.406],
        std=[0.229, 0.224, 0.225],
        crop_pct=0.875,
        decode_draft=decode_draft,
        normalize_on_device=normalize_on_device,
    )


def _deit_aug() -> AugConfig:
    return AugConfig(
        auto_augment="rand-m9-mstd0.5-inc1", reprob=0.25, remode="pixel", recount=1, hflip=0.5, color_jitter=0.3
    )


def _count_open(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], str | Path) and str(args[0]).startswith(tuple(_COUNTED_UNDER)):
        _OPENED[0] += 1


def files_opened_per_epoch(loader: Any) -> int:
    """``open`` calls while a fresh copy of the loader's dataset (what a worker process starts
    from) loads every image of this rank's epoch once."""
    dataset = pickle.loads(pickle.dumps(loader.dataset))
    before = _OPENED[0]
    if isinstance(dataset, IterableDataset):  # a stream: its epoch, as one worker reads it
        for _ in dataset:
            pass
    else:
        for index in loader.sampler:
            dataset[index]
    return _OPENED[0] - before


def build_loader(fmt: str, folder: Path, packed: Path, workers: int, batch: int, world: int) -> tuple[Any, int]:
    """The loader of ``fmt`` and the bytes its dataset holds in memory (this rank)."""
    transform = build_transform(_data_config(), _deit_aug(), is_train=True)
    if fmt == "timm":
        from timm.data import create_dataset, create_loader

        dataset = create_dataset("", root=str(folder / "train"), split="train", is_training=True)
        loader = create_loader(
            dataset,
            input_size=(3, 224, 224),
            batch_size=batch,
            is_training=True,
            auto_augment="rand-m9-mstd0.5-inc1",
            re_prob=0.25,
            color_jitter=0.3,
            interpolation="bicubic",
            num_workers=workers,
            use_prefetcher=False,
        )
        return loader, 0
    if fmt == "tar":
        stream = ShardStream(str(packed.parent / "tar"), "train", transform, world=world, batch_size=batch)
        return DataLoader(stream, batch_size=batch, num_workers=workers, drop_last=True), 0
    if fmt.startswith("folder"):
        from torchvision.datasets import ImageFolder

        from cat.data import load_rgb

        data = _data_config(decode_draft=fmt == "folder/draft")
        draft, transform = build_decoding(data, _deit_aug(), is_train=True)
        loader = functools.partial(load_rgb, draft=draft)
        dataset, sampler, held = ImageFolder(str(folder / "train"), transform=transform, loader=loader), None, 0
    else:
        mode = fmt.split("/")[1]
        if mode == "max-side":
            root, mode = packed.parent / "zip_max_side", "no"
            if fmt.endswith("/uint8"):
                transform = build_transform(_data_config(normalize_on_device=True), _deit_aug(), is_train=True)
        else:
            root = packed
        dataset = ZipImageDataset(str(root), "train", transform, cache_mode=mode, rank=0, world=world)
        sampler = RankShardSampler(len(dataset), 0, world) if mode == "part" else None
        held = dataset.cached_bytes()
    loader = DataLoader(
        dataset,
        batch_size=batch,
        shuffle=sampler is None,
        sampler=sampler,
        num_workers=workers,
        drop_last=True,
        persistent_workers=False,
    )
    return loader, held


def time_batches(loader: Any, batches: int) -> tuple[float, int]:
    """Seconds for ``batches`` batches after the first (worker start-up excluded), and their images."""
    iterator = iter(loader)
    next(iterator)
    start, images = time.perf_counter(), 0
    for _, (x, _) in zip(range(batches), iterator, strict=False):
        images += x.shape[0]
    elapsed = time.perf_counter() - start
    del iterator
    return elapsed, images


def measure(args: argparse.Namespace, folder: Path, packed: Path) -> list[dict[str, object]]:
    loaders = {f: build_loader(f, folder, packed, args.workers, args.batch, args.world) for f in args.formats}
    samples: dict[str, list[float]] = {f: [] for f in args.formats}
    for _ in range(args.rounds):
        for fmt, (loader, _) in loaders.items():  # interleaved: drift hits every format alike
            seconds, images = time_batches(loader, args.batches)
            samples[fmt].append(images / seconds / max(1, args.workers))
    _COUNTED_UNDER.append(str(folder.parent))
    sys.addaudithook(_count_open)
    return [
        {
            "format": fmt,
            "images_per_s_per_worker": statistics.median(samples[fmt]),
            "files_opened_per_epoch": files_opened_per_epoch(loader),
            # tar: the shards the rank's span of the epoch touches, each to be opened once
            "rank_shards": loader.dataset.rank_shards() if isinstance(loader.dataset, ShardStream) else None,
            "epoch_images": len(loader.dataset) if isinstance(loader.dataset, IterableDataset) else len(loader.sampler),
            "cache_mb_per_rank": held / 1e6,
        }
        for fmt, (loader, held) in loaders.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=positive_int, default=2000)
    parser.add_argument("--classes", type=positive_int, default=100)
    parser.add_argument("--data", type=Path, default=None, help="where the generated set goes (default: a temp dir)")
    parser.add_argument("--workers", type=non_negative_int, default=1, help="DataLoader worker processes per format")
    parser.add_argument("--batch", type=positive_int, default=32)
    parser.add_argument("--batches", type=positive_int, default=10, help="timed batches per round and format")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--world", type=positive_int, default=2, help="ranks sharing the set (zip/part holds 1/world)")
    parser.add_argument("--shard-mb", type=float, default=8.0, help="tar: megabytes per shard")
    parser.add_argument("--max-side", type=positive_int, default=256, help="zip/max-side: the packer's --max-side")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    needed = args.world * args.batch * (args.batches + 1)  # each rank's share: a warm-up batch, then the timed ones
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data or Path(tmp)
        folder, packed = root / "folder", root / "zip"
        if not (folder / "train").is_dir():
            if args.images < max(needed, args.classes):
                parser.error(
                    f"--images {args.images}: at least {max(needed, args.classes)} (--world {args.world} ranks x "
                    f"(--batches {args.batches} + 1 warm-up) x --batch {args.batch}, and one per --classes)"
                )
            make_imagenet_like(folder, args.images, args.classes)
        pack = runpy.run_path(str(Path(__file__).with_name("pack_dataset.py")))["main"]
        with contextlib.redirect_stdout(sys.stderr):  # the packer's progress is no part of the --json report
            if not (packed / "manifest.json").is_file():
                pack([str(folder), str(packed), "--splits", "train"])
            resized = root / "zip_max_side"
            if (
                any(f.startswith("zip/max-side") for f in args.formats)
                and (read_manifest(str(resized)) or {}).get("max_side") != args.max_side
            ):
                pack([str(folder), str(resized), "--splits", "train", "--max-side", str(args.max_side)])
            if not (root / "tar" / "manifest.json").is_file():
                shards = ["--format", "tar", "--shard-mb", str(args.shard_mb)]
                pack([str(folder), str(root / "tar"), "--splits", "train", *shards])
        rows = measure(args, folder, packed)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    setup = f"{args.images} images, {args.classes} classes, {args.workers} worker(s), batch {args.batch}"
    print(f"{setup}, world {args.world}")
    print(
        f"{'format':<18} {'img/s/worker':>13} {'files opened/epoch':>19} {'rank shards':>12} {'epoch images':>13} "
        f"{'cache MB/rank':>14}"
    )
    for r in rows:
        shards = "" if r["rank_shards"] is None else r["rank_shards"]
        print(
            f"{r['format']:<18} {r['images_per_s_per_worker']:>13.1f} {r['files_opened_per_epoch']:>19} "
            f"{shards:>12} {r['epoch_images']:>13} {r['cache_mb_per_rank']:>14.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
