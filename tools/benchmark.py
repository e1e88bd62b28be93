#!/usr/bin/env python
"""Throughput and peak memory of models over resolutions, side by side (the paper's Fig. 4).

For every resolution, each model is measured in turn in a fresh worker process (so peak memory
belongs to that configuration alone): warm-up iterations, then timed ones, reporting the median
and the 25-75% spread of images/s for forward (inference) and forward+backward (training step),
and the peak memory (CUDA: allocated; CPU: the worker's peak resident set). Before any of it, the
worker measures what its first training forward+backward adds to the peak (``train_peak_mib``,
the memory curve of the figure; as ``tools/bench_attention.py``'s memory mode takes it). FLOPs come
from ``cat.flops``. Writes ``benchmark.csv``, ``benchmark.json`` and ``fig4_efficiency.png/.pdf``.

    python tools/benchmark.py --out runs/bench                               # DeiT-T vs CA-DeiT-T, 224 and 512
    python tools/benchmark.py --models deit_tiny_patch16_224 ca_deit_tiny --res 224 512 1024 1536 --out docs/bench
    python tools/benchmark.py --device cuda --amp bf16 --channels-last --batch 64 --out runs/bench_gpu
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import cat
from cat.flops import model_cost
from cat.runtime import AMP_DTYPES, autocast_for, report_user_errors
from cat.toolkit import (
    device_name,
    non_negative_int,
    peak_growth_mib,
    peak_memory_mib,
    positive_int,
    reset_peak_memory,
    save_figure,
    time_calls,
)


def measure_one(cfg: dict) -> dict:
    """Time one (model, resolution) configuration in this process."""
    device = torch.device(cfg["device"])
    torch.manual_seed(0)
    with device:
        model = cat.create_model(cfg["model"], img_size=cfg["res"])
    x = torch.randn(cfg["batch"], 3, cfg["res"], cfg["res"], device=device)
    if cfg["channels_last"]:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    if cfg["compile"]:
        model = torch.compile(model)

    def forward() -> None:
        with torch.inference_mode(), autocast_for(device, cfg["amp"] is not None, cfg["amp"]):
            model(x)

    def train_step() -> None:
        with autocast_for(device, cfg["amp"] is not None, cfg["amp"]):
            loss = model(x).float().logsumexp(-1).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    result = {}
    if not cfg["forward_only"]:  # first, before anything else raises the process's peak
        model.train()
        result["train_peak_mib"] = peak_growth_mib(train_step, device)
    modes = (("fwd", forward),) if cfg["forward_only"] else (("fwd", forward), ("fwd_bwd", train_step))
    for mode, step in modes:
        model.train(mode == "fwd_bwd")
        reset_peak_memory(device)
        ips = cfg["batch"] / np.array(time_calls(step, cfg["iters"], cfg["warmup"], device, per_call=True))
        result[f"{mode}_img_s"] = float(np.median(ips))
        result[f"{mode}_img_s_p25"], result[f"{mode}_img_s_p75"] = (float(v) for v in np.percentile(ips, [25, 75]))
        if device.type == "cuda":
            result[f"{mode}_peak_mib"] = peak_memory_mib(device)
    if device.type != "cuda":  # the worker's lifetime peak: both modes together
        result["peak_rss_mib"] = peak_memory_mib(device)
    return result


def run_isolated(cfg: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed for {cfg['model']} at {cfg['res']}:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory = "train_peak_mib" in rows[0]
    fig, axes = plt.subplots(1, 3 if memory else 2, figsize=(13.5 if memory else 9, 3.6))
    ax_flops, ax_fps = axes[:2]
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        res = [r["res"] for r in mine]
        ax_flops.plot(res, [r["gflops"] for r in mine], "o-", label=name)
        ax_fps.plot(res, [r["fwd_img_s"] for r in mine], "o-", label=name)
        ax_fps.fill_between(res, [r["fwd_img_s_p25"] for r in mine], [r["fwd_img_s_p75"] for r in mine], alpha=0.2)
        if memory:
            axes[2].plot(res, [r["train_peak_mib"] for r in mine], "o-", label=name)
    ax_flops.set(xlabel="resolution", ylabel="GFLOPs", yscale="log", title="FLOPs")
    ax_fps.set(
        xlabel="resolution", ylabel="images / s (forward)", yscale="log", title=f"throughput ({rows[0]['device']})"
    )
    if memory:
        axes[2].set(
            xlabel="resolution",
            ylabel="MiB",
            yscale="log",
            title=f"peak memory, training step (batch {rows[0]['batch']})",
        )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, out, "fig4_efficiency", dpi=120)


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for benchmark.csv/.json and the figure")
    parser.add_argument("--models", nargs="+", default=["deit_tiny_patch16_224", "ca_deit_tiny"])
    parser.add_argument("--res", nargs="+", type=positive_int, default=[224, 512])
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--warmup", type=non_negative_int, default=2)
    parser.add_argument("--iters", type=positive_int, default=5)
    parser.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--amp", choices=sorted(AMP_DTYPES), default=None, help="autocast dtype")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--compile", action="store_true", help="torch.compile each model")
    parser.add_argument("--forward-only", action="store_true", help="skip the forward+backward measurement")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: measure one configuration
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(measure_one(json.loads(args.worker))))
        return 0
    if not args.out:
        parser.error("--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for res in args.res:
        for name in args.models:
            cfg = {
                "model": name,
                "res": res,
                "batch": args.batch,
                "warmup": args.warmup,
                "iters": args.iters,
                "device": args.device,
                "amp": args.amp,
                "channels_last": args.channels_last,
                "compile": args.compile,
                "forward_only": args.forward_only,
            }
            row = {**cfg, "gflops": model_cost(name, (res, res))[1] / 1e9, **run_isolated(cfg)}
            rows.append(row)
            train = (
                ""
                if args.forward_only
                else f"  fwd+bwd {row['fwd_bwd_img_s']:>9.2f} img/s  train peak {row['train_peak_mib']:>7.0f} MiB"
            )
            print(
                f"{name:>24} {res:>5}²  {row['gflops']:>8.2f} GFLOPs  fwd {row['fwd_img_s']:>9.2f} img/s{train}",
                flush=True,
            )
    with open(out / "benchmark.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "benchmark.json").write_text(json.dumps(rows, indent=2))
    plot(rows, out)
    if len(args.models) == 2:
        base, other = args.models
        print(f"\nforward speed-up of {other} over {base}:")
        for res in args.res:
            a, b = (next(r for r in rows if r["model"] == m and r["res"] == res) for m in (base, other))
            train = (
                ""
                if args.forward_only
                else f" (fwd+bwd {b['fwd_bwd_img_s'] / a['fwd_bwd_img_s']:.2f}x,"
                f" train memory {b['train_peak_mib'] / max(a['train_peak_mib'], 1e-9):.2f}x)"
            )
            print(f"  {res:>5}²: {b['fwd_img_s'] / a['fwd_img_s']:.2f}x{train}")
    print(f"wrote {out / 'benchmark.csv'}, benchmark.json and fig4_efficiency.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
