#!/usr/bin/env python
"""Pack an image folder (the ImageNet layout, ``<split>/<class>/*.jpg``) into one of two layouts.

* ``--format zip`` (the authors'): ``<out>/<split>.zip`` (images stored as they are: JPEGs do not
  compress) and ``<out>/<split>_map.txt`` (``<class>/<file><TAB><label>`` per image), in
  ``ImageFolder``'s order (labels equal the folder's);
* ``--format tar`` (webdataset): ``<out>/<split>-000000.tar``, ... of about ``--shard-mb`` each,
  ``<key>.<ext>`` + ``<key>.cls`` per image (the key is the image's ``ImageFolder`` index), written with
  webdataset's ``TarWriter`` in an order shuffled across the whole split (``--seed``): a stream reads
  shards in turn through a bounded shuffle buffer, so shards written class by class would give batches
  of a few classes.

``--max-side N`` stores every image whose longer side exceeds N pixels resized to N (aspect kept, Lanczos;
a JPEG re-encoded at quality 90, another format as PNG), as fast ImageNet loaders store it: fewer pixels to
decode at every epoch. The caveat: the random crops are then taken from the smaller image (the same share of
it, at fewer pixels), so a recipe trained on the full images may lose some accuracy; N = 320-512 is what such
loaders use at 224. The manifest records N.

Then ``<out>/manifest.json``: the classes, and each file's bytes, image count and sha256 (and a shard's
count per class). ``train_cls.py data.format=zip|tar data.root=<out>`` reads it; readers check sizes and
counts against the manifest, ``--verify`` checks every sha256, and of shards every header.

Only regular files inside the source folder are packed: a symbolic link that leads out of it, a link to
a folder (which could loop), a FIFO or a device is refused, and each refused entry is named. A killed
pack's temporary files are removed when the next pack starts.

    python tools/pack_dataset.py /data/imagenet /data/imagenet_zip                  # train and val
    python tools/pack_dataset.py /data/imagenet /data/imagenet_tar --format tar --shard-mb 512
    python tools/pack_dataset.py /data/imagenet /data/imagenet_zip_384 --max-side 384
    python tools/pack_dataset.py --verify /data/imagenet_zip
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import random
import sys
import zipfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cat.data import IMAGE_EXTENSIONS
from cat.data.folders import class_folders, split_images, utf8_name
from cat.data.manifest import MANIFEST, read_manifest
from cat.data.shards import scan_shard
from cat.data.untrusted import decode_image, image_limit
from cat.errors import DataError
from cat.runtime import remove_stale_temporaries, report_user_errors
from cat.runtime.io import atomic_write, atomic_write_json, atomic_write_text
from cat.toolkit import positive_int


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def split_members(folder: Path, classes: list[str], root: Path) -> tuple[list[tuple[str, int]], list[str]]:
    """``(member name, label)`` of every image under ``folder`` by the readers' rule
    (:func:`cat.data.folders.split_images`), named relative to ``folder``, and the entries refused; a member's
    name must be UTF-8 (zip and tar names are text)."""
    found = class_folders(str(folder))
    if found != classes:
        raise DataError(f"{folder} has classes {found[:5]}..., not the train split's {classes[:5]}...")
    found_images, refused = split_images(str(folder), classes, str(root))
    images, limit = [], image_limit(None)
    for path, label in found_images:
        if (size := os.stat(path).st_size) > limit:  # before a byte is read: a sparse 3 GiB file reads whole
            refused.append(f"{path}: {size / 1e6:.1f} MB, over the {limit / 1e6:g} MB an image may have")
            continue
        try:
            images.append((utf8_name(os.path.relpath(path, folder)), label))
        except ValueError:
            refused.append(f"{os.fsencode(path)!r}: its name is not UTF-8")
    if not images:
        raise DataError(f"{folder} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    return images, refused


def image_bytes(path: Path, max_side: int | None) -> bytes:
    """The bytes to store for the image file ``path``: as it is, or (``max_side``) resized so its longer side is
    at most ``max_side`` pixels, a JPEG re-encoded as JPEG (quality 90), another format as PNG."""
    data = path.read_bytes()
    if max_side is None:
        return data
    from PIL import Image

    size, fmt = decode_image(data, f"image {path}", lambda header: (header.size, header.format))
    if max(size) <= max_side:
        return data
    scale = max_side / max(size)
    image = decode_image(data, f"image {path}").resize(
        (max(1, round(size[0] * scale)), max(1, round(size[1] * scale))), Image.LANCZOS
    )
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90) if fmt == "JPEG" else image.save(out, "PNG")
    return out.getvalue()


def pack_zip(
    source: Path, out: Path, split: str, classes: list[str], max_side: int | None = None
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    images, refused = split_members(source / split, classes, source)
    archive, listing = out / f"{split}.zip", out / f"{split}_map.txt"

    def write_zip(f) -> None:
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as z:
            for member, _ in images:
                z.writestr(member, image_bytes(source / split / member, max_side))

    atomic_write(str(archive), write_zip)
    atomic_write_text(str(listing), "".join(f"{m}\t{label}\n" for m, label in images))
    files = {
        path.name: {"bytes": path.stat().st_size, "images": len(images), "sha256": sha256_of(path)}
        for path in (archive, listing)
    }
    return files, refused


def pack_tar(
    source: Path, out: Path, split: str, classes: list[str], shard_bytes: int, seed: int, max_side: int | None = None
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """``<split>-000000.tar``, ...: ``<key>.<ext>`` + ``<key>.cls`` per image (webdataset's TarWriter),
    a new shard once one holds ``shard_bytes`` of images; images in an order shuffled by ``seed``
    (keys are their ImageFolder indices). Each shard is written atomically: an interrupted run leaves
    no partial shard."""
    from webdataset import TarWriter

    images, refused = split_members(source / split, classes, source)
    order = list(range(len(images)))
    random.Random(seed).shuffle(order)
    groups: list[list[int]] = [[]]
    held = 0
    for index in order:
        if groups[-1] and held >= shard_bytes:
            groups.append([])
            held = 0
        groups[-1].append(index)
        held += (source / split / images[index][0]).stat().st_size

    def write_shard(indices: list[int]) -> Callable[[Any], None]:
        def write(f: Any) -> None:
            writer = TarWriter(f, encoder=False)
            for index in indices:
                member, label = images[index]
                extension = Path(member).suffix.lstrip(".").lower()
                data = image_bytes(source / split / member, max_side)
                writer.write({"__key__": f"{index:08d}", extension: data, "cls": str(label).encode()})
            writer.close()

        return write

    files = {}
    for number, indices in enumerate(groups):
        path = out / f"{split}-{number:06d}.tar"
        atomic_write(str(path), write_shard(indices))
        per_class = Counter(images[i][1] for i in indices)
        files[path.name] = {
            "bytes": path.stat().st_size,
            "images": len(indices),
            "sha256": sha256_of(path),
            "class_counts": [per_class.get(label, 0) for label in range(len(classes))],
        }
    return files, refused


def _packed_names(out: Path) -> list[str]:
    """The files in ``out`` that a reader would take for packed splits (shards and zip splits)."""
    return sorted(
        e.name
        for e in os.scandir(out)
        if (e.name.endswith((".zip", "_map.txt")) or (e.name.endswith(".tar") and "-" in e.name))
        and not e.name.startswith(".")
    )


def verify(out: Path) -> list[str]:
    """Every file the manifest names, checked byte for byte (its sha256), every shard's headers (its count,
    its labels, its end), and no packed-looking file the manifest does not name; without a manifest (shards
    another tool wrote) the shards' headers alone. The problems, if any."""
    manifest = read_manifest(str(out))
    if manifest is None:
        shards = [name for name in _packed_names(out) if name.endswith(".tar")]
        if not shards:
            raise DataError(f"no {out / MANIFEST}: {out} is not a packed root (tools/pack_dataset.py writes one there)")
        return [problem for name in shards if (problem := _shard_problem(out / name, None, None))]
    problems = []
    classes = manifest.get("classes")
    for name, entry in manifest["files"].items():
        path = out / name
        if Path(name).name != name or name in ("", ".", ".."):
            problems.append(f"{out / MANIFEST}: {name!r} is not an entry for a file of {out}")
        elif not path.is_file():
            problems.append(f"{path}: missing")
        elif sha256_of(path) != entry.get("sha256"):
            problems.append(f"{path}: sha256 differs from the manifest's (altered or truncated)")
        elif name.endswith(".tar") and (problem := _shard_problem(path, entry, classes)):
            problems.append(problem)
    stray = [name for name in _packed_names(out) if name not in manifest["files"]]
    problems += [
        f"{out / name}: not in {out / MANIFEST} (a stray file: the trainer refuses the split)" for name in stray
    ]
    return problems


def _shard_problem(path: Path, entry: dict[str, Any] | None, classes: list[str] | None) -> str | None:
    """What a shard's headers say against its manifest entry (if any), or None."""
    try:
        found = scan_shard(str(path), image_limit(None))
    except DataError as error:
        return str(error)
    if entry is not None and found["images"] != entry.get("images"):
        return f"{path}: holds {found['images']} samples, the manifest says {entry.get('images')}"
    beyond = [label for label in found["labels"] if classes is not None and label >= len(classes)]
    if beyond:
        return f"{path}: label {max(beyond)} is not one of the manifest's {len(classes)} classes"
    counts = entry.get("class_counts") if entry is not None else None
    if counts is not None and [found["labels"].get(i, 0) for i in range(len(counts))] != counts:
        return f"{path}: its labels do not match the manifest's class_counts"
    if entry is None:
        print(f"{path}: {found['images']} samples, {len(found['labels'])} labels (headers only: no manifest)")
    return None


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="the image folder root (or, with --verify, a packed root)")
    parser.add_argument("out", type=Path, nargs="?", help="where the packed files go")
    parser.add_argument("--splits", nargs="+", default=["train", "val"])
    parser.add_argument("--format", choices=("zip", "tar"), default="zip")
    parser.add_argument("--shard-mb", type=float, default=256.0, help="tar: image megabytes per shard")
    parser.add_argument("--seed", type=int, default=0, help="tar: the seed of the order images are written in")
    parser.add_argument(
        "--max-side", type=positive_int, default=None, help="store images resized to at most this longer side"
    )
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
    if os.path.commonpath([os.path.realpath(args.out), os.path.realpath(args.source)]) == os.path.realpath(args.source):
        raise DataError(
            f"the output folder {args.out} is inside the source folder {args.source}: what is packed there would be "
            "read as images (a class of its own) by the next pack or run; choose a folder outside it"
        )
    classes = class_folders(str(args.source / args.splits[0]))
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DataError(f"cannot make the output folder {args.out} ({error.strerror or error})") from None
    for path in remove_stale_temporaries(str(args.out)):
        print(f"removed {path}, left by a pack that was killed")
    files: dict[str, dict[str, object]] = {}
    for split in args.splits:
        packed, refused = (
            pack_zip(args.source, args.out, split, classes, args.max_side)
            if args.format == "zip"
            else pack_tar(args.source, args.out, split, classes, int(args.shard_mb * 1e6), args.seed, args.max_side)
        )
        for entry in refused:
            print(f"refused {entry}", file=sys.stderr)
        files.update(packed)
        images = sum(e["images"] for name, e in packed.items() if not name.endswith(".txt"))
        megabytes = sum(e["bytes"] for e in packed.values()) / 1e6
        skipped = f" ({len(refused)} refused: listed above)" if refused else ""
        print(f"{split}: {images} images in {len(packed)} file(s), {megabytes:.1f} MB{skipped}")
    order = {"order": f"shuffled, seed {args.seed}"} if args.format == "tar" else {}
    resized = {"max_side": args.max_side} if args.max_side is not None else {}
    manifest = {"format": args.format, "classes": classes, **order, **resized, "files": files}
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
