#!/usr/bin/env python
"""Parameters and FLOPs (multiply-accumulates, as the paper counts them) of any timm model.

    python tools/flops.py ca_deit_tiny deit_tiny_patch16_224                   # 224x224
    python tools/flops.py ca_deit_tiny --img-size 224 --img-size 1024 --img-size 800 1280
    python tools/flops.py ca_deit_small --img-size 512 768 --json            # H=512, W=768
"""
from __future__ import annotations

import argparse
import json
import sys

import timm
import torch

import cat  # noqa: F401  (registers cat's models with timm)
from cat.flops import count_macs


def measure(name: str, img_size: tuple[int, int]) -> dict[str, object]:
    """Build ``name`` on the meta device (no memory, no weights) and count one forward at ``img_size``."""
    with torch.device("meta"):
        try:
            model = cat.create_model(name, img_size=img_size)
        except TypeError:  # models without an img_size argument (e.g. convnets) take any size
            model = cat.create_model(name)
        model.eval()
        params = sum(p.numel() for p in model.parameters())
        macs = count_macs(model, torch.empty(1, 3, *img_size))
    return {"model": name, "img_size": list(img_size), "params": params, "flops": macs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="timm model names (cat's models are registered)")
    parser.add_argument("--img-size", nargs="+", type=int, action="append", metavar=("H", "W"),
                        help="input resolution: H (square) or H W; repeat the flag for several (default 224)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of raw counts")
    args = parser.parse_args(argv)

    resolutions = []
    for size in args.img_size or [[224]]:
        if len(size) > 2:
            parser.error(f"--img-size takes H or H W, got {size}; repeat the flag for several resolutions")
        resolutions.append((size[0], size[-1]))
    rows = [measure(m, r) for m in args.models for r in resolutions]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'model':<32} {'input':>11} {'params (M)':>11} {'GFLOPs':>9}")
    for row in rows:
        h, w = row["img_size"]
        print(f"{row['model']:<32} {f'{h}x{w}':>11} {row['params'] / 1e6:>11.2f} {row['flops'] / 1e9:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
