#!/usr/bin/env python
"""Side-by-side forward timings: circulant attention vs timm's softmax attention (fused SDPA).

Part 1 times the attention modules alone on an S x S token grid at C channels (timm's
``Attention`` with C/64 heads, as in DeiT). Part 2 times whole models (forward, eval mode) at full
image resolutions. Every pair is measured in the same run with ``torch.utils.benchmark``
(medians of blocked runs), so the ratios are what matter, not the absolute times.

    python tools/bench_attention.py                       # C=192, grids 14 28 56 96; models at 224, 1024
    python tools/bench_attention.py --grids 14 28 --models-res 224 --json
"""
from __future__ import annotations

import argparse
import json
import sys

import timm
import torch
from timm.layers import Attention
from torch.utils import benchmark

import cat  # noqa: F401  (registers cat's models with timm)
from cat.ops import CirculantAttention


def median_seconds(fn, min_run_time: float) -> float:
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def bench_modules(dim: int, grids: list[int], batch: int, min_run_time: float) -> list[dict]:
    circulant = CirculantAttention(dim).eval()
    softmax = Attention(dim, num_heads=max(dim // 64, 1), qkv_bias=True).eval()
    rows = []
    for side in grids:
        x = torch.randn(batch, side * side, dim)
        with torch.inference_mode():
            t_ca = median_seconds(lambda: circulant(x, (side, side)), min_run_time)
            t_sm = median_seconds(lambda: softmax(x), min_run_time)
        rows.append({"tokens": f"{side}x{side}", "batch": batch, "circulant_ms": t_ca * 1e3,
                     "softmax_sdpa_ms": t_sm * 1e3, "speedup": t_sm / t_ca})
    return rows


def bench_models(pairs: list[tuple[str, str]], resolutions: list[int], batch: int, min_run_time: float) -> list[dict]:
    rows = []
    for res in resolutions:
        for ca_name, base_name in pairs:
            ca = timm.create_model(ca_name, img_size=res).eval()
            base = timm.create_model(base_name, img_size=res).eval()
            x = torch.randn(batch, 3, res, res)
            with torch.inference_mode():
                t_ca = median_seconds(lambda: ca(x), min_run_time)
                t_base = median_seconds(lambda: base(x), min_run_time)
            rows.append({"resolution": res, "batch": batch, "model": ca_name, "baseline": base_name,
                         "model_img_s": batch / t_ca, "baseline_img_s": batch / t_base, "speedup": t_base / t_ca})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=192, help="channels C of the attention modules")
    parser.add_argument("--grids", type=int, nargs="*", default=[14, 28, 56, 96], help="token grid sides S")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--models-res", type=int, nargs="*", default=[224, 1024],
                        help="image resolutions for the whole-model comparison (none to skip)")
    parser.add_argument("--pair", nargs=2, action="append", metavar=("CA_MODEL", "BASELINE"),
                        help="model pair to compare (default: ca_deit_tiny deit_tiny_patch16_224)")
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds per measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    result = {
        "device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__,
        "modules": bench_modules(args.dim, args.grids, args.batch, args.min_run_time),
        "models": bench_models([tuple(p) for p in args.pair] if args.pair else [("ca_deit_tiny", "deit_tiny_patch16_224")],
                               args.models_res, args.batch, args.min_run_time),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"torch {result['torch']}, CPU, {result['threads']} threads; C={args.dim}, batch {args.batch}")
    print(f"{'tokens':>9} {'circulant ms':>13} {'softmax SDPA ms':>16} {'CA speed-up':>12}")
    for r in result["modules"]:
        print(f"{r['tokens']:>9} {r['circulant_ms']:>13.3f} {r['softmax_sdpa_ms']:>16.3f} {r['speedup']:>11.2f}x")
    if result["models"]:
        print(f"\n{'resolution':>10} {'model':>14} {'img/s':>9} {'baseline':>24} {'img/s':>9} {'speed-up':>9}")
        for r in result["models"]:
            print(f"{r['resolution']:>10} {r['model']:>14} {r['model_img_s']:>9.2f} {r['baseline']:>24} "
                  f"{r['baseline_img_s']:>9.2f} {r['speedup']:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
