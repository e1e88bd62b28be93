#!/usr/bin/env python
"""Write a small semantic-segmentation dataset in the exact ADE20K layout.

Images of coloured shapes on noisy backgrounds and their PNG label maps, ADE20K-style: 0 means
"unlabelled" (ignored with ``reduce_zero_label``), then 1 = background, 2 = circle, 3 = square,
4 = triangle (a thin unlabelled band outlines every shape, as ADE20K's boundaries often are):

    OUT_DIR/images/training/*.jpg      OUT_DIR/annotations/training/*.png
    OUT_DIR/images/validation/*.jpg    OUT_DIR/annotations/validation/*.png

    python tools/make_toy_ade.py data/toy_ade                        # 64 train / 16 val images, 128x128
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from cat.data.toy_shapes import SHAPES, draw_scene
from cat.runtime import report_user_errors
from cat.toolkit import toy_dataset_parser

CLASSES = ("background", *SHAPES)  # label k + 1 is CLASSES[k]; 0 is unlabelled


def make_split(out: Path, split: str, count: int, size: int, rng: np.random.Generator) -> None:
    images, labels = out / "images" / split, out / "annotations" / split
    images.mkdir(parents=True, exist_ok=True)
    labels.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        image, shapes = draw_scene(rng, size)
        label = Image.new("L", (size, size), color=1)
        draw_label = ImageDraw.Draw(label)
        for shape, points in shapes:
            draw_label.polygon(points, fill=shape + 1, outline=0, width=1)
        name = f"ADE_toy_{split}_{index:08d}"
        image.save(images / f"{name}.jpg", quality=95)
        label.save(labels / f"{name}.png")


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    args = toy_dataset_parser(__doc__).parse_args(argv)

    out = Path(args.out_dir)
    rng = np.random.default_rng(args.seed)
    make_split(out, "training", args.train, args.size, rng)
    make_split(out, "validation", args.val, args.size, rng)
    print(
        f"wrote {args.train} training and {args.val} validation images ({args.size}x{args.size}) in ADE20K "
        f"layout to {out}; classes after reduce_zero_label: {', '.join(CLASSES)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
