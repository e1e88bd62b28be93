#!/usr/bin/env python
"""Pack an image folder (the ImageNet layout, ``<split>/<class>/*.jpg``) into one of two layouts.

* ``--format zip`` (the authors'): ``<out>/<split>.zip`` (images stored as they are: JPEGs do not
  compress) and ``<out>/<split>_map.txt`` (``<class>/<file><TAB><label>`` per image);
* ``--format tar`` (webdataset): ``<out>/<split>-000000.tar``, ... of about ``--shard-mb`` each,
  ``<key>.<ext>`` + ``<key>.cls`` per image, written with webdataset's ``TarWriter``.

Images go in ``ImageFolder``'s order, so labels equal the folder's. Then ``<out>/manifest.json``: the
classes, and each file's bytes, image count and sha256. ``train_cls.py data.format=zip|tar
data.root=<out>`` reads it; readers check sizes and counts against the manifest, ``--verify``
checks every sha256.

    python tools/pack_dataset.py /data/imagenet /data/imagenet_zip                  # train and val
    python tools/pack_dataset.py /data/imagenet /data/imagenet_tar --format tar --shard-mb 512
    python tools/pack_dataset.py --verify /data/imagenet_zip
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cat.data import IMAGE_EXTENSIONS  # noqa: E402
from cat.data.packed import MANIFEST, read_manifest  # noqa: E402
from cat.errors import DataError  # noqa: E402
from cat.runtime import report_user_errors  # noqa: E402
from cat.runtime.io import atomic_write, atomic_write_json, atomic_write_text  # noqa: E402


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def split_images(folder: Path, classes: list[str]) -> list[tuple[str, int]]:
    """``(member name, label)`` of every image under ``folder``, in torchvision ImageFolder's order."""
    found = sorted(e.name for e in os.scandir(folder) if e.is_dir())
    if found != classes:
        raise DataError(f"{folder} has classes {found[:5]}..., not the train split's {classes[:5]}...")
    images = []
    for label, name in enumerate(classes):
        for directory, _, files in sorted(os.walk(folder / name, followlinks=True)):
            for file in sorted(files):
                if file.lower().endswith(IMAGE_EXTENSIONS):
                    images.append((os.path.relpath(os.path.join(directory, file), folder), label))
    if not images:
        raise DataError(f"{folder} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    return images


def pack_zip(source: Path, out: Path, split: str, classes: list[str]) -> dict[str, dict[str, object]]:
    images = split_images(source / split, classes)
    archive, listing = out / f"{split}.zip", out / f"{split}_map.txt"

    def write_zip(f) -> None:
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as z:
            for member, _ in images:
                z.write(source / split / member, arcname=member)

    atomic_write(str(archive), write_zip)
    atomic_write_text(str(listing), "".join(f"{m}\t{label}\n" for m, label in images))
    return {
        path.name: {"bytes": path.stat().st_size, "images": len(images), "sha256": sha256_of(path)}
        for path in (archive, listing)
    }


def pack_tar(source: Path, out: Path, split: str, classes: list[str], shard_bytes: int) -> dict[str, dict[str, object]]:
    """``<split>-000000.tar``, ...: ``<key>.<ext>`` + ``<key>.cls`` per image (webdataset's TarWriter),
    a new shard once one holds ``shard_bytes`` of images; images in ImageFolder's order (keys are
    positions). Each shard is written atomically: an interrupted run leaves no partial shard."""
    from webdataset import TarWriter

    images = split_images(source / split, classes)
    groups: list[list[int]] = [[]]
    held = 0
    for index, (member, _) in enumerate(images):
        if groups[-1] and held >= shard_bytes:
            groups.append([])
            held = 0
        groups[-1].append(index)
        held += (source / split / member).stat().st_size

    def write_shard(indices: list[int]) -> Callable[[Any], None]:
        def write(f: Any) -> None:
            writer = TarWriter(f, encoder=False)
            for index in indices:
                member, label = images[index]
                extension = Path(member).suffix.lstrip(".").lower()
                data = (source / split / member).read_bytes()
                writer.write({"__key__": f"{index:08d}", extension: data, "cls": str(label).encode()})
            writer.close()

        return write

    files = {}
    for number, indices in enumerate(groups):
        path = out / f"{split}-{number:06d}.tar"
        atomic_write(str(path), write_shard(indices))
        files[path.name] = {"bytes": path.stat().st_size, "images": len(indices), "sha256": sha256_of(path)}
    return files


def verify(out: Path) -> list[str]:
    """Every file the manifest names, checked byte for byte (its sha256): the problems, if any."""
    manifest = read_manifest(str(out))
    if manifest is None:
        raise DataError(f"no {out / MANIFEST}: {out} is not a packed root (tools/pack_dataset.py writes one there)")
    problems = []
    for name, entry in manifest["files"].items():
        path = out / name
        if Path(name).name != name or name in ("", ".", "..") or not isinstance(entry, dict):
            problems.append(f"{out / MANIFEST}: {name!r} is not an entry for a file of {out}")
        elif not path.is_file():
            problems.append(f"{path}: missing")
        elif sha256_of(path) != entry.get("sha256"):
            problems.append(f"{path}: sha256 differs from the manifest's (altered or truncated)")
    return problems


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="the image folder root (or, with --verify, a packed root)")
    parser.add_argument("out", type=Path, nargs="?", help="where the packed files go")
    parser.add_argument("--splits", nargs="+", default=["train", "val"])
    parser.add_argument("--format", choices=("zip", "tar"), default="zip")
    parser.add_argument("--shard-mb", type=float, default=256.0, help="tar: image megabytes per shard")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check a packed root's files against its manifest (with an output folder: the one just packed)",
    )
    args = parser.parse_args(argv)
    if args.verify and args.out is None:
        return report_verified(args.source)
    if args.out is None:
        parser.error("give the output folder (or --verify alone, to check a packed root)")
    missing = next((split for split in args.splits if not (args.source / split).is_dir()), None)
    if missing is not None:  # before anything is written
        raise DataError(f"no {args.source / missing} folder to pack (--splits names the split folders to pack)")
    classes = sorted(e.name for e in os.scandir(args.source / args.splits[0]) if e.is_dir())
    args.out.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, object]] = {}
    for split in args.splits:
        packed = (
            pack_zip(args.source, args.out, split, classes)
            if args.format == "zip"
            else pack_tar(args.source, args.out, split, classes, int(args.shard_mb * 1e6))
        )
        files.update(packed)
        images = sum(e["images"] for name, e in packed.items() if not name.endswith(".txt"))
        megabytes = sum(e["bytes"] for e in packed.values()) / 1e6
        print(f"{split}: {images} images in {len(packed)} file(s), {megabytes:.1f} MB")
    manifest = {"format": args.format, "classes": classes, "files": files}
    atomic_write_json(str(args.out / MANIFEST), manifest)
    return report_verified(args.out) if args.verify else 0


def report_verified(out: Path) -> int:
    """Print what :func:`verify` finds in ``out``; the exit status."""
    problems = verify(out)
    for problem in problems:
        print(problem)
    print("ok" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
