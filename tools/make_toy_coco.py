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

import json
import sys
from pathlib import Path

import numpy as np

from cat.data.toy_shapes import SHAPES, draw_scene, polygon_area
from cat.runtime import report_user_errors
from cat.toolkit import toy_dataset_parser

CATEGORIES = [{"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(SHAPES)]


def make_split(out: Path, split: str, count: int, size: int, rng: np.random.Generator, first_ann_id: int) -> int:
    folder = out / f"{split}2017"
    folder.mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    ann_id = first_ann_id
    for image_id in range(1, count + 1):
        canvas, shapes = draw_scene(rng, size)
        for category, points in shapes:
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            x0, y0 = max(min(xs), 0.0), max(min(ys), 0.0)
            x1, y1 = min(max(xs), size - 1.0), min(max(ys), size - 1.0)
            annotations.append(
                {
                    "id": ann_id,
                    "image_id": image_id,
                    "category_id": category,
                    "iscrowd": 0,
                    "segmentation": [[round(c, 2) for p in points for c in p]],
                    "area": round(polygon_area(points), 2),
                    "bbox": [round(x0, 2), round(y0, 2), round(x1 - x0, 2), round(y1 - y0, 2)],
                }
            )
            ann_id += 1
        name = f"{image_id:012d}.jpg"
        canvas.save(folder / name, quality=95)
        images.append({"id": image_id, "file_name": name, "width": size, "height": size})
    (out / "annotations").mkdir(exist_ok=True)
    coco = {
        "info": {"description": f"cat toy COCO ({split})"},
        "licenses": [],
        "images": images,
        "annotations": annotations,
        "categories": CATEGORIES,
    }
    (out / "annotations" / f"instances_{split}2017.json").write_text(json.dumps(coco))
    return ann_id


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    args = toy_dataset_parser(__doc__).parse_args(argv)

    out = Path(args.out_dir)
    rng = np.random.default_rng(args.seed)
    next_id = make_split(out, "train", args.train, args.size, rng, 1)
    make_split(out, "val", args.val, args.size, rng, next_id)
    print(f"wrote {args.train} train and {args.val} val images ({args.size}x{args.size}) in COCO layout to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
