#!/usr/bin/env python
"""Which of the paper's Table 2 recipes fit a 40 or 80 GB GPU as they are, and what makes the rest fit.

For every Table 2 model at its resolution, one fresh process measures the memory a training
forward+backward adds at two small batches, as trained (the lean circulant attention, AMP in
``--dtype``) and with activation checkpointing (``model.grad_checkpointing=true``). Activation memory
grows linearly with the batch, so the difference is the memory per image. At the recipe's batch per
GPU (``batch_size=128``: global 1024 on 8 GPUs) the estimate is

    16 B x params (fp32 weights, gradients, AdamW's two moments) + per-image x batch + --overhead-gib

and a GPU is taken to hold 90 % of its memory. Each row says what fits: the recipe as is,
``model.grad_checkpointing=true``, or ``accum_steps=k`` (the smallest k whose batch/k fits; the
global batch, learning rate and schedule are unchanged). Measured on this machine's CPU (its
allocator and FFT library, not CUDA's): an estimate to plan with, not a guarantee.

    python tools/recipe_memory.py                      # bf16 autocast (amp.enabled=true), the whole table
    python tools/recipe_memory.py --dtype fp32 --models ca_deit_base deit_base_patch16_224 --json
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import timm

from cat.models import on_meta
from cat.paper import paper_table
from cat.runtime import AMP_DTYPES, report_user_errors
from cat.toolkit import positive_int

BENCH = Path(__file__).with_name("bench_attention.py")
GPUS_GIB = (40, 80)
USABLE = 0.9


def measure(model_name: str, res: int, batches: tuple[int, int], dtype: str) -> dict[str, float]:
    """Parameters, and the MiB one training forward+backward adds for every (variant, batch) of one
    model: tools/bench_attention.py's memory worker, each in its own process (memory freed by an
    earlier step stays resident and would hide a later one's growth), two at a time."""
    jobs = [(v, b) for v in ("plain", "ckpt") for b in batches]

    def run(variant_batch: tuple[str, int]) -> float:
        variant, batch = variant_batch
        # "+lean": at the recipe's batch every circulant block is past lean_attention=auto's threshold,
        # while the small measured batches may not be (a softmax model is unchanged by it).
        name = model_name + ("+checkpointed" if variant == "ckpt" else "+lean")
        cmd = [sys.executable, str(BENCH), "--device", "cpu", *(["--amp", dtype] if dtype in AMP_DTYPES else [])]
        proc = subprocess.run([*cmd, "--memory-worker", name, str(res), str(batch)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"memory worker failed for {name} at batch {batch}:\n{proc.stderr[-2000:]}")
        return float(proc.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(2) as pool:
        growth = {f"{v}_{b}": mib for (v, b), mib in zip(jobs, pool.map(run, jobs), strict=True)}
    with on_meta():
        params = sum(p.numel() for p in timm.create_model(model_name, img_size=res).parameters())
    return {"params": float(params), **growth}


def smallest_accum(gib_per_image: float, batch: int, room_gib: float) -> int | None:
    """The smallest accum_steps k >= 2 whose micro-batch ceil(batch / k) fits ``room_gib``."""
    return next((k for k in range(2, batch + 1) if gib_per_image * math.ceil(batch / k) <= room_gib), None)


def plan(growth: dict[str, float], batches: tuple[int, int], recipe_batch: int, overhead_gib: float) -> dict:
    """The estimate at ``recipe_batch`` per GPU and what fits each GPU size."""
    fixed_gib = 16 * growth["params"] / 2**30 + overhead_gib
    lo, hi = batches
    per_image = {v: max(growth[f"{v}_{hi}"] - growth[f"{v}_{lo}"], 0.0) / (hi - lo) / 1024 for v in ("plain", "ckpt")}
    row: dict[str, object] = {
        "params_m": growth["params"] / 1e6,
        "gib_per_image": per_image["plain"],
        "gib_per_image_ckpt": per_image["ckpt"],
        "estimate_gib": fixed_gib + per_image["plain"] * recipe_batch,
        "estimate_gib_ckpt": fixed_gib + per_image["ckpt"] * recipe_batch,
    }
    for gpu in GPUS_GIB:
        room = USABLE * gpu - fixed_gib
        accum = smallest_accum(per_image["plain"], recipe_batch, room)
        if per_image["plain"] * recipe_batch <= room:
            row[f"fits_{gpu}"] = "as is"
        elif per_image["ckpt"] * recipe_batch <= room:
            row[f"fits_{gpu}"] = "grad_checkpointing" + (f" or accum_steps={accum}" if accum else "")
        else:
            row[f"fits_{gpu}"] = f"accum_steps={accum}" if accum else "does not fit"
    return row


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", help="Table 2 model names (default: every row)")
    parser.add_argument("--dtype", choices=sorted(AMP_DTYPES) + ["fp32"], default="bf16")
    parser.add_argument("--batches", type=positive_int, nargs=2, default=(8, 16), help="the two measured batches")
    parser.add_argument("--recipe-batch", type=positive_int, default=128, help="images per GPU (global 1024 on 8)")
    parser.add_argument("--overhead-gib", type=float, default=1.0, help="CUDA context and allocator slack")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    batches = tuple(args.batches)
    if batches[0] == batches[1]:
        parser.error(f"--batches {batches[0]} {batches[1]}: two different batches (memory per image is their slope)")
    table = paper_table(2)["rows"]
    unknown = sorted(set(args.models or ()) - {r["model"] for r in table})
    if unknown:
        parser.error(
            f"--models {' '.join(unknown)}: not in Table 2 (its models: {', '.join(r['model'] for r in table)})"
        )
    rows = [r for r in table if not args.models or r["model"] in args.models]
    results = []
    for row in rows:
        growth = measure(row["model"], row["img_size"], batches, args.dtype)
        results.append(
            {
                "label": row["label"],
                "model": row["model"],
                "img_size": row["img_size"],
                **plan(growth, batches, args.recipe_batch, args.overhead_gib),
            }
        )
        if not args.json:
            r = results[-1]
            mib, mib_ckpt = r["gib_per_image"] * 1024, r["gib_per_image_ckpt"] * 1024
            print(
                f"| {r['label']} | {r['img_size']} | {mib:.0f} | {mib_ckpt:.0f} | {r['estimate_gib']:.1f} "
                f"| {r['estimate_gib_ckpt']:.1f} | {r['fits_40']} | {r['fits_80']} |",
                flush=True,
            )
    if args.json:
        print(
            json.dumps(
                {"dtype": args.dtype, "batches": batches, "recipe_batch": args.recipe_batch, "rows": results}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
