#!/usr/bin/env python
"""The paper's Fig. 4, measured: circulant attention against softmax attention over resolution, and the
throughput-accuracy trade-off of both families at 224^2.

(a, b)  CA-DeiT-T (as created: circulant attention's policies ``auto``) against DeiT-T with SDPA (timm's fused
        attention) and DeiT-T with its softmax written as matrix products (``+matmul``: timm's
        ``TIMM_FUSED_ATTN=0``, the paper-era baseline): FLOPs, inference images/s and the training step's time
        (forward, cross-entropy, backward, AdamW) at each --res in each --dtypes, the models interleaved round by
        round in one process (medians of --rounds); and what one training step asks of the device, counted at the
        dispatcher (:mod:`cat.toolkit.dispatch`): the kernels and the most tensor memory of its forward, loss and
        backward (the optimizer's are the same for every model of a size).
(c, d)  inference and training throughput at 224^2 of DeiT-T/S/B and CA-DeiT-T/S/B against the paper's ImageNet
        top-1 (cat/paper_tables.yaml, Table 2), in the first of --dtypes.
host    the host's cost of a training step: the CPU time of CA-DeiT-T's forward, cross-entropy and backward at 32^2,
        batch 1, on one thread, against DeiT-T's (SDPA), in float32 and under bf16 autocast, interleaved. Arithmetic
        is negligible there, so the time is what issuing the step's operators costs the host (Python, autograd, the
        dispatcher): on a GPU, what bounds a small model's eager step (docs/perf.md).
Writes ``benchmark.json`` and ``fig4_efficiency.png``/``.pdf`` into --out.

    python tools/benchmark.py --out runs/fig4                  # CPU: 224^2 and 512^2 in fp32, a few minutes
    python tools/benchmark.py --device cuda --out runs/fig4    # the whole figure: 224^2 to 1536^2, fp32 and bf16
    python tools/benchmark.py --device cuda --compile-mode reduce-overhead --out runs/fig4_graphs  # compiled, graphs
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import cat  # noqa: F401  (registers cat's models with timm)
from cat.paper import paper_table
from cat.runtime import AMP_DTYPES, autocast_for, report_user_errors
from cat.runtime.io import atomic_write_text, refuse_planted
from cat.toolkit import device_name, interleaved_medians
from cat.toolkit.cli import float_between, int_between, output_folder
from cat.toolkit.dispatch import count_kernels, peak_tensor_bytes
from cat.toolkit.fig4 import MODELS, gflops, plot
from cat.toolkit.timing import median_quartiles
from cat.toolkit.variants import inference_variant, train_step_fns

FAMILIES = ("DeiT-T", "DeiT-S", "DeiT-B", "CA-DeiT-T", "CA-DeiT-S", "CA-DeiT-B")  # labels of Table 2's rows
# Images per step at 224^2 on each device kind; larger resolutions keep the tokens per step (never below 1).
BATCH_224 = {"cuda": 64, "cpu": 8}
RESOLUTIONS = {"cuda": [224, 512, 1024, 1536], "cpu": [224, 512]}
ROUNDS = {"cuda": 7, "cpu": 3}
DTYPES = {"cuda": ["fp32", "bf16"], "cpu": ["fp32"]}
MAX_RES = 4096  # 65,536 tokens a map: past it a step measures the allocator, not the model


def batch_at(res: int, device: torch.device) -> int:
    base = BATCH_224.get(device.type, 8)
    return max(1, min(base, round(base * (224 / res) ** 2)))


def autocast(device: torch.device, dtype: str) -> Callable[[], Any]:
    return lambda: autocast_for(device, dtype != "fp32", dtype if dtype != "fp32" else None)


def inference_fns(specs: dict[str, str], res: int, batch: int, device: torch.device, dtype: str, args) -> dict:
    x = torch.randn(batch, 3, res, res, device=device)
    fns = {}
    for label, spec in specs.items():
        model = inference_variant(spec, res, device, {})
        forward = torch.compile(model, mode=args.compile_mode) if args.compile_mode else model

        def infer(forward=forward) -> None:
            with torch.inference_mode(), autocast(device, dtype)():
                forward(x)

        fns[label] = infer
    return fns


def measure(
    specs: dict[str, str], res: int, device: torch.device, dtype: str, args, counted: bool = True
) -> dict[str, dict[str, float]]:
    """Images/s of inference and of training, interleaved, and (``counted``) one training step's kernels and peak
    tensor memory, of each model at ``res`` in ``dtype``."""
    batch = batch_at(res, device)
    infer = inference_fns(specs, res, batch, device, dtype, args)
    compiled = args.compile_mode is not None
    train = train_step_fns(list(specs.values()), res, batch, device, compiled, {}, autocast(device, dtype))
    train = {label: train[spec] for label, spec in specs.items()}
    for fn in (*infer.values(), *train.values()):  # warm-up: allocator pools, cuFFT plans, lazy initialisation
        fn()
    infer_s = interleaved_medians(infer, args.rounds, args.min_block)
    train_s = interleaved_medians(train, args.rounds, args.min_block)
    rows = {}
    for label in specs:
        rows[label] = {
            "batch": batch,
            "infer_img_s": batch / infer_s[label],
            "train_step_ms": train_s[label] * 1e3,
            "train_img_s": batch / train_s[label],
        }
        if not counted:
            continue
        one_step = functools.partial(train[label], optimize=False)  # forward, loss, backward: the model's own
        rows[label] |= {
            # Counted eagerly: a compiled step's kernels are Inductor's and do not pass the dispatcher.
            "train_kernels": None if compiled else sum(count_kernels(one_step).values()),
            "train_peak_mib": None if compiled else peak_tensor_bytes(one_step) / 2**20,
        }
    return rows


HOST_RES, HOST_BATCH = 32, 1


def host_cost(pairs: int, min_block_s: float) -> dict[str, dict[str, float]]:
    """The CPU time (process time) of one training step of CA-DeiT-T against DeiT-T (SDPA) at 32^2, batch 1, on one
    thread, in fp32 and under bf16 autocast: ``pairs`` blocks of each (about ``min_block_s`` of calls), one after the
    other in alternating order, so that the machine's drifts cancel within each pair's ratio; the median ratio and
    its quartiles, and the median milliseconds of each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = {}
        for dtype in ("fp32", "bf16"):
            specs = [MODELS["CA-DeiT-T"], MODELS["DeiT-T (SDPA)"]]
            cast = autocast(torch.device("cpu"), dtype)
            steps = train_step_fns(specs, HOST_RES, HOST_BATCH, "cpu", False, {"num_classes": 10}, cast)
            fns = {spec: functools.partial(steps[spec], optimize=False) for spec in specs}
            calls = {}
            for spec, fn in fns.items():  # warm, and size each block
                fn()
                started = time.process_time()
                fn()
                calls[spec] = max(1, int(min_block_s / max(time.process_time() - started, 1e-4)))

            def block(spec: str, fns=fns, calls=calls) -> float:
                started = time.process_time()
                for _ in range(calls[spec]):
                    fns[spec]()
                return (time.process_time() - started) / calls[spec]

            samples: dict[str, list[float]] = {spec: [] for spec in specs}
            ratios = []
            for i in range(pairs):
                seconds = {spec: block(spec) for spec in (specs if i % 2 == 0 else specs[::-1])}
                for spec, value in seconds.items():
                    samples[spec].append(value)
                ratios.append(seconds[specs[0]] / seconds[specs[1]])
            ratio, q1, q3 = median_quartiles(ratios)
            result[dtype] = {
                "CA-DeiT-T ms": statistics.median(samples[specs[0]]) * 1e3,
                "DeiT-T (SDPA) ms": statistics.median(samples[specs[1]]) * 1e3,
                "ratio": ratio,
                "ratio_q1": q1,
                "ratio_q3": q3,
            }
        return result
    finally:
        torch.set_num_threads(threads)


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for benchmark.json and the figure")
    parser.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--res", type=int_between(32, MAX_RES), nargs="+", help="resolutions of (a, b) (default: by device)"
    )
    parser.add_argument("--dtypes", nargs="+", choices=["fp32", *sorted(AMP_DTYPES)], help="default: by device")
    parser.add_argument(
        "--rounds", type=int_between(1, 1000), help="interleaved rounds per median (default: by device)"
    )
    parser.add_argument(
        "--min-block", type=float_between(0, 10), default=0.2, help="seconds of calls per timed block (at most 10)"
    )
    parser.add_argument("--no-families", action="store_true", help="leave out (c, d)")
    parser.add_argument("--no-host-cost", action="store_true", help="leave out the host's cost of a step")
    parser.add_argument(
        "--families", nargs="+", choices=FAMILIES, default=list(FAMILIES), help="the models of (c, d) (default: all)"
    )
    parser.add_argument("--families-res", type=int_between(32, MAX_RES), default=224, help="the resolution of (c, d)")
    parser.add_argument(
        "--compile-mode",
        choices=["default", "reduce-overhead", "max-autotune"],
        help="torch.compile every model in this mode (reduce-overhead: CUDA graphs); default: eager",
    )
    args = parser.parse_args(argv)
    args.families = list(dict.fromkeys(args.families))  # each once, in the order given
    device = torch.device(args.device)
    resolutions = args.res or RESOLUTIONS.get(device.type, [224])
    dtypes = args.dtypes or DTYPES.get(device.type, ["fp32"])
    args.rounds = args.rounds or ROUNDS.get(device.type, 3)
    out = output_folder(args.out)
    for output in ("benchmark.json", "fig4_efficiency.png", "fig4_efficiency.pdf"):  # refused before any measuring
        refuse_planted(str(out / output))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    result: dict[str, Any] = {
        "device": name,
        "torch": torch.__version__,
        "compile_mode": args.compile_mode,
        "resolutions": resolutions,
        "gflops": {label: {str(r): gflops(spec, r) for r in resolutions} for label, spec in MODELS.items()},
        "speed": {},
    }
    print(f"{name}, torch {torch.__version__}; medians of {args.rounds} interleaved rounds")
    for dtype in dtypes:
        result["speed"][dtype] = {}
        for res in resolutions:
            rows = measure(MODELS, res, device, dtype, args)
            result["speed"][dtype][str(res)] = rows
            for label, row in rows.items():
                extra = (
                    ""
                    if row["train_kernels"] is None
                    else f"  {row['train_kernels']:>5} kernels/step  peak {row['train_peak_mib']:>7.0f} MiB"
                )
                print(
                    f"{dtype} {res:>5}² B={row['batch']:<3} {label:>16}  {result['gflops'][label][str(res)]:>7.1f} "
                    f"GFLOPs  inference {row['infer_img_s']:>8.1f} img/s  training {row['train_step_ms']:>8.1f} "
                    f"ms/step{extra}",
                    flush=True,
                )
            base = rows["CA-DeiT-T"]
            print(
                "          CA-DeiT-T against SDPA / matmul softmax: inference "
                + " / ".join(f"{base['infer_img_s'] / rows[k]['infer_img_s']:.2f}x" for k in list(MODELS)[1:])
                + ", training "
                + " / ".join(f"{rows[k]['train_step_ms'] / base['train_step_ms']:.2f}x" for k in list(MODELS)[1:])
            )
    result["families"] = []
    if not args.no_families:
        rows_by_label = {row["label"]: row for row in paper_table(2)["rows"] if row["label"] in FAMILIES}
        specs = {label: rows_by_label[label]["model"] for label in args.families}
        result["families_dtype"] = dtypes[0]
        speed = measure(specs, args.families_res, device, dtypes[0], args, counted=False)  # (c, d) plot speed only
        result["families_res"] = args.families_res
        for label in args.families:
            row = {"label": label, "model": specs[label], "top1": rows_by_label[label]["paper"]["top1"]}
            result["families"].append(row | {k: speed[label][k] for k in ("batch", "infer_img_s", "train_img_s")})
            print(
                f"{label:>10} top-1 {row['top1']:.1f}  inference {speed[label]['infer_img_s']:>8.1f} img/s  "
                f"training {speed[label]['train_img_s']:>8.1f} img/s ({dtypes[0]}, {args.families_res}², batch "
                f"{speed[label]['batch']})"
            )
    if not args.no_host_cost:
        result["host_cost"] = host_cost(max(args.rounds, 11), min(max(args.min_block, 0.1), 1.0))
        for dtype, row in result["host_cost"].items():
            print(
                f"host cost of a training step at {HOST_RES}², batch {HOST_BATCH}, one thread, {dtype}: CA-DeiT-T "
                f"{row['CA-DeiT-T ms']:.1f} ms, DeiT-T {row['DeiT-T (SDPA) ms']:.1f} ms of CPU: {row['ratio']:.2f}x "
                f"(paired; quartiles {row['ratio_q1']:.2f}-{row['ratio_q3']:.2f})"
            )
    atomic_write_text(str(out / "benchmark.json"), json.dumps(result, indent=2))  # never through a planted link
    plot(result, out)
    print(f"wrote {out / 'benchmark.json'} and fig4_efficiency.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
