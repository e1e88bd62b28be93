#!/usr/bin/env python
"""Write the quick-start's digits (train_cls.py with no overrides) as an image folder, for tools that read
folders: timm's own train.py, torchvision's ImageFolder, cat's data=folder.

    OUT_DIR/train/<digit>/<index>.png  OUT_DIR/val/<digit>/<index>.png

The same fixed stratified split, upsampled the same way (bilinear, to --img-size), as 8-bit greyscale PNGs: what
the quick-start trains on, up to the 8-bit rounding. Normalise with mean 0.3, std 0.4 (the quick-start's).

    python tools/export_folder.py data/digits
    python -m cat.timm path/to/timm/train.py data/digits --val-split val ...   # the README's full command
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from PIL import Image

from cat.data.tensor_sets import DIGITS_MEAN, DIGITS_STD, digits_images
from cat.errors import shortened
from cat.toolkit import positive_int

# The largest image side written: a split is upsampled at once in float32 (1,797 digits at 512^2: 1.9 GB).
MAX_IMG_SIZE = 512


def write_split(out: Path, split: str, img_size: int) -> int:
    """The digits of ``split`` as ``out/split/<label>/<index>.png``, each file new (created exclusively: nothing is
    ever overwritten); returns how many."""
    images, labels = digits_images(split, img_size)
    pixels = images.squeeze(1).mul(255).round().clamp(0, 255).byte().numpy()
    for index, (image, label) in enumerate(zip(pixels, labels.tolist(), strict=True)):
        folder = out / split / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{index:05d}.png", "xb") as file:
            Image.fromarray(image, mode="L").save(file, format="PNG")
    return len(labels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--img-size", type=positive_int, default=32, help="image side (the quick-start's: 32)")
    args = parser.parse_args(argv)
    if args.img_size > MAX_IMG_SIZE:
        parser.error(f"--img-size {args.img_size}: at most {MAX_IMG_SIZE} (8x8 digits, upsampled)")
    given = Path(args.out_dir)
    try:  # every step may meet the path's own trouble: a name too long, a file on the way, a read-only place
        if given.is_symlink() or (given.exists() and not given.is_dir()):
            parser.error(f"{shortened(given)} is not a folder (a link or a file); choose a new or empty folder")
        # The folder the writes land in: 'X/new/..' is X, whatever the name says.
        out = Path(os.path.realpath(given))
        if out.exists() and any(out.iterdir()):
            parser.error(f"{shortened(given)} ({shortened(out)}) is not empty; choose a new or empty folder")
        counts = {split: write_split(out, split, args.img_size) for split in ("train", "val")}
    except OSError as error:
        where = shortened(error.filename or given)
        parser.error(f"cannot write the digits into {shortened(given)}: {error.strerror or error} ({where})")
    print(
        f"wrote {counts['train']} train and {counts['val']} val digits ({args.img_size}x{args.img_size} greyscale PNG) "
        f"to {out}; normalise with mean {DIGITS_MEAN} and std {DIGITS_STD}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
