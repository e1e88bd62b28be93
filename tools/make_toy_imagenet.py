#!/usr/bin/env python
"""Write a small classification dataset in the ImageNet folder layout, as JPEGs of ImageNet's sizes.

Each class is one shape (circle, square, triangle) in one colour family on a noisy background, so a
small model can learn it; images are ~500x375 (sides drawn around ImageNet's typical 500x375 and
375x500) and saved at JPEG quality 75-95, like the photographs a real run decodes:

    OUT_DIR/train/<class>/*.JPEG  OUT_DIR/val/<class>/*.JPEG

    python tools/make_toy_imagenet.py data/toy_imagenet                       # 6 classes, 300 train / 60 val
    python train_cls.py data=folder data.root=data/toy_imagenet aug=deit      # the DeiT recipe on it
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from cat.data.toy_shapes import SHAPES, shape_polygon

HUES = ((230, 60, 60), (60, 200, 80), (70, 110, 240), (230, 200, 50))  # red, green, blue, yellow


def class_names(count: int) -> list[str]:
    """``count`` class folder names, ``<index>_<colour>_<shape>`` (sorted = index order)."""
    colours = ("red", "green", "blue", "yellow")
    return [f"{k:03d}_{colours[k // len(SHAPES) % len(HUES)]}_{SHAPES[k % len(SHAPES)]}" for k in range(count)]


def draw_example(rng: np.random.Generator, label: int) -> Image.Image:
    """One image of class ``label``: its shape in its colour (jittered), at a random place and scale."""
    w, h = (500, 375) if rng.random() < 0.75 else (375, 500)
    w, h = int(w * rng.uniform(0.8, 1.0)), int(h * rng.uniform(0.8, 1.0))
    background = rng.integers(0, 90, 3) + rng.normal(0, 18, (h, w, 3))
    image = Image.fromarray(np.clip(background, 0, 255).astype(np.uint8))
    hue = np.array(HUES[label // len(SHAPES) % len(HUES)]) + rng.integers(-25, 26, 3)
    r = float(rng.uniform(0.2, 0.35) * min(w, h))
    cx, cy = float(rng.uniform(r, w - r)), float(rng.uniform(r, h - r))
    points = shape_polygon(label % len(SHAPES) + 1, cx, cy, r, float(rng.uniform(0, 2 * math.pi)))
    ImageDraw.Draw(image).polygon(points, fill=tuple(int(c) for c in np.clip(hue, 0, 255)))
    return image


def write_split(out: Path, split: str, per_class: int, names: list[str], rng: np.random.Generator) -> int:
    for label, name in enumerate(names):
        folder = out / split / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            image = draw_example(rng, label)
            quality = int(rng.integers(75, 96))
            image.save(folder / f"{split}_{i:05d}.JPEG", "JPEG", quality=quality)
    return per_class * len(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--classes", type=int, default=6, help=f"number of classes (at most {len(SHAPES) * len(HUES)})")
    parser.add_argument("--train", type=int, default=50, help="training images per class")
    parser.add_argument("--val", type=int, default=10, help="validation images per class")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 2 <= args.classes <= len(SHAPES) * len(HUES):
        parser.error(f"--classes must be between 2 and {len(SHAPES) * len(HUES)}")
    if args.train < 1 or args.val < 1:
        parser.error("--train and --val must be at least 1")
    rng = np.random.default_rng(args.seed)
    out = Path(args.out_dir)
    names = class_names(args.classes)
    n_train = write_split(out, "train", args.train, names, rng)
    n_val = write_split(out, "val", args.val, names, rng)
    print(f"wrote {n_train} train and {n_val} val JPEGs ({args.classes} classes, ~500x375) in ImageNet layout to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
