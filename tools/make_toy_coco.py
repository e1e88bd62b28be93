#!/usr/bin/env python
"""Write a small detection/instance-segmentation dataset in the exact COCO layout.

Images of coloured shapes (circles, squares, triangles) on noisy backgrounds, each shape a COCO
instance with a polygon segmentation, its box and area:

    OUT_DIR/train2017/*.jpg  OUT_DIR/val2017/*.jpg
    OUT_DIR/annotations/instances_train2017.json  OUT_DIR/annotations/instances_val2017.json

    python tools/make_toy_coco.py data/toy_coco                      # 64 train / 16 val images, 128x128
    python tools/make_toy_coco.py data/toy_coco --train 200 --size 256
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from cat.data.toy_shapes import SHAPES, place_shapes, polygon_area

CATEGORIES = [{"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(SHAPES)]


def make_split(out: Path, split: str, count: int, size: int, rng: np.random.Generator, first_ann_id: int) -> int:
    folder = out / f"{split}2017"
    folder.mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    ann_id = first_ann_id
    for image_id in range(1, count + 1):
        background = rng.integers(0, 80, 3)
        pixels = np.clip(background + rng.normal(0, 12, (size, size, 3)), 0, 255).astype(np.uint8)
        canvas = Image.fromarray(pixels)
        draw = ImageDraw.Draw(canvas)
        for category, points in place_shapes(rng, size):
            draw.polygon(points, fill=tuple(int(c) for c in rng.integers(120, 256, 3)))
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            x0, y0 = max(min(xs), 0.0), max(min(ys), 0.0)
            x1, y1 = min(max(xs), size - 1.0), min(max(ys), size - 1.0)
            annotations.append({"id": ann_id, "image_id": image_id, "category_id": category, "iscrowd": 0,
                                "segmentation": [[round(c, 2) for p in points for c in p]],
                                "area": round(polygon_area(points), 2),
                                "bbox": [round(x0, 2), round(y0, 2), round(x1 - x0, 2), round(y1 - y0, 2)]})
            ann_id += 1
        name = f"{image_id:012d}.jpg"
        canvas.save(folder / name, quality=95)
        images.append({"id": image_id, "file_name": name, "width": size, "height": size})
    (out / "annotations").mkdir(exist_ok=True)
    coco = {"info": {"description": f"cat toy COCO ({split})"}, "licenses": [], "images": images,
            "annotations": annotations, "categories": CATEGORIES}
    (out / "annotations" / f"instances_{split}2017.json").write_text(json.dumps(coco))
    return ann_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=int, default=64, help="training images")
    parser.add_argument("--val", type=int, default=16, help="validation images")
    parser.add_argument("--size", type=int, default=128, help="image side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    out = Path(args.out_dir)
    rng = np.random.default_rng(args.seed)
    next_id = make_split(out, "train", args.train, args.size, rng, 1)
    make_split(out, "val", args.val, args.size, rng, next_id)
    print(f"wrote {args.train} train and {args.val} val images ({args.size}x{args.size}) in COCO layout to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
