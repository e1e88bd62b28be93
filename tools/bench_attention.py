#!/usr/bin/env python
"""Circulant-attention speed, side by side with its baselines (medians of interleaved runs).

For C channels on S x S token grids it times, in one run and interleaved round by round:
  * ``ours``      the ``CirculantAttention`` module (``fft`` backend, and ``matmul`` with --matmul);
  * ``released``  the released CA-DeiT pipeline written literally (``cat.ops.reference``);
  * ``sdpa``      timm's softmax ``Attention`` (fused scaled_dot_product_attention), C/64 heads;
  * ``gemm``      the module's own linear layers alone on the same tokens (gate, qkv, proj, each on
                  N rows, as the packed spectrum has them): the floor any implementation pays.
Forward, and forward+backward with --backward. Then the cost-growth exponent of ours vs softmax
attention over larger grids (slope of log time vs log N), and whole models (CA-DeiT-T vs DeiT-T,
images/s, forward) at the --models-res resolutions and --models-batches batches.

Training mode (--train-res): a whole training step (forward, cross-entropy, backward, AdamW step) of
each of the --train-models, interleaved, at each resolution, relative to the first; with --pairs and
--processes also single steps in pairs, in fresh processes, pooled, with --profile-ops where the time goes (each
operator's self time per step, the difference from the first model pooled over the processes), and with --alone
each model in a process of its own, as a training run has it, and with --compile every model compiled. Memory mode
(--memory-res): the peak memory of one training forward+backward of each model of the
--memory-pairs at each resolution, every one in a fresh process (CPU: the growth of the process's
peak resident set; CUDA: of the peak allocated), and the ratio of each model to its softmax baseline.
Models are MODEL[+VARIANT] (:mod:`cat.toolkit.variants`): as created (circulant attention's policies ``auto``),
``+lean`` or ``+stored`` (every block's backward from its input alone, or from kept spectra:
``set_lean_attention``), ``+released`` (the released pipeline), ``+checkpointed`` (any model: timm's activation
checkpointing, what ``model.grad_checkpointing=true`` does in training), ``+converted`` (a softmax model after
``cat.convert``: the plug-in), ``+matmul`` (softmax attention as matrix products: the paper's baseline),
``+separable`` (circulant attention's DFTs as GEMMs). ``--model-arg KEY=VALUE`` builds every one of them with that
argument (e.g. ``depth=2``: a compile's time grows with the depth).

    python tools/bench_attention.py                                  # C=192: 14^2 (B=8), 28^2 (B=2), 56^2 (B=1)
    python tools/bench_attention.py --backward --matmul --growth 28 48 64 96 128 --models-res 224 1536
    python tools/bench_attention.py --grids --train-res 224 512 --train-batches 8 2   # training steps
    python tools/bench_attention.py --grids --train-res 224 --train-batches 8 --train-models ca_deit_tiny \
        deit_tiny_patch16_224+converted --pairs 10 --processes 6 --profile-ops 4   # ... and where they differ
    python tools/bench_attention.py --grids --train-res 1024 --train-batches 1 --train-models ca_deit_tiny \
        deit_tiny_patch16_224+converted --pairs 8 --processes 6 --alone 6          # ... and each model alone
    python tools/bench_attention.py --grids --train-res 224 --train-batches 8 --train-models ca_deit_tiny \
        deit_tiny_patch16_224+converted --pairs 10 --processes 2 --compile         # ... both compiled
    python tools/bench_attention.py --grids --memory-res 1024       # train memory, CA vs softmax models
    python tools/bench_attention.py --grids --memory-res 1024 --memory-pairs \
        ca_deit_tiny+checkpointed:ca_deit_tiny deit_tiny_patch16_224+checkpointed:deit_tiny_patch16_224
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from timm.layers import Attention

import cat  # noqa: F401  (registers cat's models with timm)
from cat.models import parse_model_args
from cat.ops import CirculantAttention
from cat.ops.reference import released_circulant_attention
from cat.runtime import AMP_DTYPES, autocast_for, report_user_errors
from cat.toolkit import check_model_size, device_name, positive_int, timing
from cat.toolkit.variants import build_variant, inference_variant, split_variant, train_step_fns


def module_candidates(dim: int, side: int, batch: int, backward: bool, matmul: bool) -> dict[str, Callable[[], object]]:
    ours = CirculantAttention(dim)
    softmax = Attention(dim, num_heads=max(dim // 64, 1), qkv_bias=True)
    x = torch.randn(batch, side * side, dim, requires_grad=backward)
    hw = (side, side)

    def gemm_floor() -> torch.Tensor:
        return ours.gate(x).sum() + F.linear(x, ours.qkv.weight).sum() + ours.proj(x).sum()

    fns = {
        "ours": lambda: ours(x, hw),
        "released": lambda: released_circulant_attention(ours, x, hw),
        "sdpa": lambda: softmax(x),
        "gemm": gemm_floor,
    }
    if matmul:
        ours_mm = CirculantAttention(dim, fft_backend="matmul")
        ours_mm.load_state_dict(ours.state_dict())
        fns["ours_matmul"] = lambda: ours_mm(x, hw)
    if not backward:

        def no_grad(fn):
            def run():
                with torch.inference_mode():
                    return fn()

            return run

        return {name: no_grad(fn) for name, fn in fns.items()}

    def with_backward(fn):
        def run():
            fn().sum().backward()

        return run

    return {name: with_backward(fn) for name, fn in fns.items()}


def growth_exponent(dim: int, sides: list[int], rounds: int, min_block_s: float) -> dict[str, float]:
    """Slope of log(time) against log(N) for ours and softmax attention (batch 1, forward)."""
    times: dict[str, list[float]] = {"ours": [], "sdpa": []}
    for side in sides:
        fns = module_candidates(dim, side, 1, backward=False, matmul=False)
        t = timing.interleaved_medians({k: fns[k] for k in times}, rounds, min_block_s)
        for k in times:
            times[k].append(t[k])
    log_n = np.log([s * s for s in sides])
    return {k: float(np.polyfit(log_n, np.log(v), 1)[0]) for k, v in times.items()}


def whole_models(resolutions: list[int], batches: list[int], rounds: int, min_block_s: float) -> list[dict[str, float]]:
    rows = []
    for i, res in enumerate(resolutions):
        batch = batches[min(i, len(batches) - 1)]
        ca, deit = (inference_variant(name, res, "cpu", {}) for name in ("ca_deit_tiny", "deit_tiny_patch16_224"))
        x = torch.randn(batch, 3, res, res)

        def run(model, x=x):
            def call():
                with torch.inference_mode():
                    return model(x)

            return call

        t = timing.interleaved_medians({"ca_deit_tiny": run(ca), "deit_tiny": run(deit)}, rounds, min_block_s)
        rows.append(
            {
                "resolution": res,
                "batch": batch,
                "ca_deit_tiny_img_s": batch / t["ca_deit_tiny"],
                "deit_tiny_img_s": batch / t["deit_tiny"],
                "speedup": t["deit_tiny"] / t["ca_deit_tiny"],
            }
        )
    return rows


def train_memory(model_name: str, res: int, batch: int, device: str, model_args: dict[str, Any]) -> float:
    """MiB one training forward+backward adds to the peak (call in a fresh process)."""
    model = build_variant(model_name, res, device, model_args)
    x = torch.randn(batch, 3, res, res, device=device)

    def step() -> None:
        model(x).logsumexp(-1).mean().backward()

    return timing.peak_growth_mib(step, device)


# A process's tensors land where its allocator puts them, and on CPU that alone moved one model against
# another by 3 % (docs/perf.md: an elementwise op 3x slower when its input and output alias modulo 4 KiB).
# Worker i of --processes K first holds i * HEAP_SHIFT_BYTES // K bytes, so each worker's heap is laid out anew.
HEAP_SHIFT_BYTES = 4096 + 64 * 17


def train_pairs_worker(spec: dict, device: str) -> dict[str, dict]:
    """One --processes worker: the paired ratios of ``spec``'s models at its resolution and batch, and with
    ``profile_calls`` each model's operator self times per step (:func:`~cat.toolkit.timing.op_self_ms`),
    profiled after the pairs."""
    _heap_shift = torch.empty(spec["index"] * HEAP_SHIFT_BYTES // spec["processes"], dtype=torch.uint8)  # held
    fns = train_step_fns(spec["models"], spec["res"], spec["batch"], device, spec["compile"], spec["model_args"])
    ratios = timing.paired_ratios(fns, spec["pairs"], device)
    return {"ratios": ratios, "ops": timing.op_self_ms(fns, spec["profile_calls"]) if spec["profile_calls"] else None}


def train_alone_worker(spec: dict, device: str) -> float:
    """One --alone worker: the median seconds of ``spec["steps"]`` training steps of the one model ``spec["model"]``,
    alone in this process, after two warm-up steps."""
    (step,) = train_step_fns(
        [spec["model"]], spec["res"], spec["batch"], device, spec["compile"], spec["model_args"]
    ).values()
    return float(np.median(timing.time_calls(step, spec["steps"], 2, device, per_call=True)))


def worker_command(device: str, amp: str | None, *worker: str) -> list[str]:
    """This tool run as a worker in a fresh process, with the parent's device and autocast."""
    return [sys.executable, __file__, "--device", device, *(["--amp", amp] if amp else []), *worker]


def run_worker(cmd: list[str], what: str) -> str:
    """The last line a worker printed (its result); a worker's failure is an error naming ``what``."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed for {what}:\n{proc.stderr[-2000:]}")
    return proc.stdout.strip().splitlines()[-1]


def pooled_pairs(
    models: list[str],
    res: int,
    batch: int,
    pairs: int,
    processes: int,
    device: str,
    amp: str | None,
    profile_calls: int,
    compiled: bool,
    model_args: dict[str, Any],
) -> dict[str, object]:
    """:func:`train_steps`' pairs in ``processes`` fresh workers, pooled, and with ``profile_calls`` the operator
    differences from the first model (:func:`~cat.toolkit.timing.op_differences`): its row's entries."""
    spec = {
        "models": models,
        "res": res,
        "batch": batch,
        "pairs": pairs,
        "processes": processes,
        "profile_calls": profile_calls,
        "compile": compiled,
        "model_args": model_args,
    }
    runs = [
        json.loads(
            run_worker(
                worker_command(device, amp, "--train-worker", json.dumps({**spec, "index": k})),
                f"the paired steps at {res}^2 (process {k})",
            )
        )
        for k in range(processes)
    ]
    row: dict[str, object] = {f"{models[0]}_paired": [1.0, 1.0, 1.0]}
    for name in models[1:]:
        ratios = [run["ratios"][name] for run in runs]
        row[f"{name}_paired"] = list(timing.median_quartiles([r for per_run in ratios for r in per_run]))
        row[f"{name}_paired_by_process"] = [timing.median_quartiles(per_run)[0] for per_run in ratios]
        if profile_calls:
            row[f"{name}_ops"] = timing.op_differences([run["ops"] for run in runs], models[0], name)
    return row


def alone_rounds(
    models: list[str],
    res: int,
    batch: int,
    steps: int,
    rounds: int,
    device: str,
    amp: str | None,
    compiled: bool,
    model_args: dict[str, Any],
) -> dict[str, object]:
    """:func:`train_steps`' models alone: ``rounds`` rounds of one fresh process per model (the order rotating),
    each timing ``steps`` steps; per model the ratios of each round's medians, pooled, and its medians by round."""
    medians: dict[str, list[float]] = {name: [] for name in models}
    for k in range(rounds):
        for name in timing.rotated(models, k):
            spec = {
                "model": name,
                "res": res,
                "batch": batch,
                "steps": steps,
                "compile": compiled,
                "model_args": model_args,
            }
            cmd = worker_command(device, amp, "--alone-worker", json.dumps(spec))
            medians[name].append(float(run_worker(cmd, f"{name} alone at {res}^2 (round {k})")))
    row: dict[str, object] = {}
    for name in models:
        ratios = [b / t for b, t in zip(medians[models[0]], medians[name], strict=True)]
        row[f"{name}_alone"] = list(timing.median_quartiles(ratios))
        row[f"{name}_alone_ms_by_round"] = [t * 1e3 for t in medians[name]]
    return row


def train_steps(
    models: list[str],
    resolutions: list[int],
    batches: list[int],
    rounds: int,
    min_block_s: float,
    device: str,
    pairs: int = 0,
    processes: int = 0,
    amp: str | None = None,
    profile_calls: int = 0,
    alone_steps: int = 0,
    compiled: bool = False,
    model_args: dict[str, Any] | None = None,
) -> list[dict[str, object]]:
    """A whole training step (forward, cross-entropy, backward, AdamW) of each model, interleaved, per
    resolution; each model's speed relative to the first (its time over theirs), and with ``pairs`` also
    from single steps in pairs with the first (:func:`paired_speedups`: median and quartiles): in this
    process, or with ``processes`` in that many fresh ones, pooled (:func:`pooled_pairs`, with ``profile_calls``
    also where the time differs, operator by operator). With ``alone_steps`` and ``processes``, also each model
    alone in processes of its own (:func:`alone_rounds`): in one process two models share the allocator, and on
    CPU one model's frees decide whether the other's next step faults pages back in (docs/perf.md, attempt 21).
    ``compiled``: every model through ``torch.compile``; ``model_args``: every model built with them."""
    model_args = model_args or {}
    rows = []
    for i, res in enumerate(resolutions):
        batch = batches[min(i, len(batches) - 1)]
        fns = train_step_fns(models, res, batch, device, compiled, model_args)
        t = timing.interleaved_medians(fns, rounds, min_block_s)
        row: dict[str, object] = {
            "resolution": res,
            "batch": batch,
            **{f"{name}_ms": t[name] * 1e3 for name in models},
            **{f"{name}_speed": t[models[0]] / t[name] for name in models},
        }
        if processes:
            del fns  # the workers get the machine to themselves
            if pairs:
                row.update(
                    pooled_pairs(models, res, batch, pairs, processes, device, amp, profile_calls, compiled, model_args)
                )
            if alone_steps:
                row.update(alone_rounds(models, res, batch, alone_steps, processes, device, amp, compiled, model_args))
        elif pairs:
            row.update({f"{name}_paired": list(v) for name, v in timing.paired_speedups(fns, pairs, device).items()})
        rows.append(row)
    return rows


def memory_table(
    pairs: list[str], resolutions: list[int], batch: int, device: str, amp: str | None = None, model_arg: tuple = ()
) -> list[dict[str, object]]:
    """Every model of every ``model:baseline`` pair at every resolution, each in a fresh process (with the
    ``--model-arg`` values ``model_arg``)."""

    def isolated(model: str, res: int) -> float:
        extra = [f"--model-arg={pair}" for pair in model_arg]
        cmd = worker_command(device, amp, "--memory-worker", model, str(res), str(batch), *extra)
        return float(run_worker(cmd, f"the memory of {model} at {res}^2"))

    rows = []
    for res in resolutions:
        for pair in pairs:
            model, _, baseline = pair.partition(":")
            if not baseline:
                raise ValueError(f"--memory-pairs takes MODEL:BASELINE; got {pair!r}")
            mib, base_mib = isolated(model, res), isolated(baseline, res)
            rows.append(
                {
                    "model": model,
                    "baseline": baseline,
                    "resolution": res,
                    "batch": batch,
                    "model_mib": mib,
                    "baseline_mib": base_mib,
                    "ratio": mib / base_mib if base_mib > 0 else float("nan"),
                }
            )
    return rows


def measure(args: argparse.Namespace) -> dict[str, object]:
    """Every timing the arguments ask for, in the current device and autocast context."""
    device = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    )
    result: dict[str, object] = {"torch": torch.__version__, "device": device, "amp": args.amp, "dim": args.dim}
    result["compile"] = args.compile
    for mode in (("forward", "forward_backward") if args.backward else ("forward",)) if args.grids else ():
        rows = []
        for i, side in enumerate(args.grids):
            batch = args.batches[min(i, len(args.batches) - 1)]
            fns = module_candidates(args.dim, side, batch, mode != "forward", args.matmul)
            t = timing.interleaved_medians(fns, args.rounds, args.min_block)
            rows.append({"tokens": f"{side}x{side}", "batch": batch, **{f"{k}_ms": v * 1e3 for k, v in t.items()}})
        result[mode] = rows
    if args.growth:
        result["growth_exponent"] = growth_exponent(args.dim, args.growth, max(3, args.rounds // 2), args.min_block)
    if args.models_res:
        result["models"] = whole_models(args.models_res, args.models_batches, max(3, args.rounds // 2), args.min_block)
    if args.train_res:
        result["train_steps"] = train_steps(
            args.train_models,
            args.train_res,
            args.train_batches,
            max(3, args.rounds // 2),
            args.min_block,
            args.device,
            args.pairs,
            args.processes,
            args.amp,
            args.profile_ops,
            args.alone,
            args.compile,
            parse_model_args(args.model_arg),
        )
    if args.memory_res:
        result["train_memory"] = memory_table(
            args.memory_pairs, args.memory_res, args.memory_batch, args.device, args.amp, args.model_arg
        )
    return result


def report(args: argparse.Namespace, result: dict) -> None:
    device = result["device"]
    print(
        f"torch {result['torch']}, {device}, amp {args.amp}, C={args.dim}; medians of {args.rounds} interleaved rounds"
    )
    for mode in ("forward", "forward_backward"):
        if mode not in result:
            continue
        rows = result[mode]
        names = [k[:-3] for k in rows[0] if k.endswith("_ms")]
        print(
            f"\n{mode.replace('_', '+')} (ms)   "
            + " ".join(f"{n:>11}" for n in names)
            + "  speed vs released  time / GEMM floor  speed vs SDPA"
        )
        for r in rows:
            ms = [r[f"{n}_ms"] for n in names]
            print(
                f"{r['tokens']:>7} B={r['batch']:<2} "
                + " ".join(f"{v:>11.3f}" for v in ms)
                + f"  {r['released_ms'] / r['ours_ms']:>16.2f}x {r['ours_ms'] / r['gemm_ms']:>17.2f}x"
                f" {r['sdpa_ms'] / r['ours_ms']:>13.2f}x"
            )
    if "growth_exponent" in result:
        g = result["growth_exponent"]
        print(
            f"\ncost growth over {args.growth[0]}^2..{args.growth[-1]}^2 tokens: time ~ N^{g['ours']:.2f} (ours), "
            f"N^{g['sdpa']:.2f} (softmax SDPA)"
        )
    for r in result.get("models", []):
        print(
            f"CA-DeiT-T vs DeiT-T at {r['resolution']}^2, batch {r['batch']}: {r['ca_deit_tiny_img_s']:.2f} vs "
            f"{r['deit_tiny_img_s']:.2f} img/s = {r['speedup']:.2f}x"
        )
    for r in result.get("train_steps", []):
        names = [k[: -len("_speed")] for k in r if k.endswith("_speed")]
        where = f" in each of {args.processes} fresh processes, pooled" if args.processes else ""
        paired = f"; paired: median of {args.pairs} step pairs{where} (q1-q3)" if args.pairs else ""
        how = ", every model compiled" if args.compile else ""
        print(f"\ntraining step at {r['resolution']}^2, batch {r['batch']}{how} (speed relative to {names[0]}{paired})")
        for name in names:
            line = f"{name:>36} {r[f'{name}_ms']:>9.1f} ms {r[f'{name}_speed']:>6.2f}x"
            if f"{name}_paired" in r:
                median, q1, q3 = r[f"{name}_paired"]
                line += f"   paired {median:.3f}x ({q1:.3f}-{q3:.3f})"
            if f"{name}_paired_by_process" in r:
                line += "  by process " + " ".join(f"{m:.3f}" for m in r[f"{name}_paired_by_process"])
            print(line)
        if f"{names[0]}_alone" in r:
            print(
                f"  each model alone in its own process ({args.alone} steps after two warm-up steps, {args.processes} "
                f"rounds of one process per model): median step (ms) by round; speed relative to {names[0]}, "
                "median of the rounds' ratios (q1-q3)"
            )
            for name in names:
                median, q1, q3 = r[f"{name}_alone"]
                by_round = " ".join(f"{t:.0f}" for t in r[f"{name}_alone_ms_by_round"])
                print(f"{name:>36}   alone {median:.3f}x ({q1:.3f}-{q3:.3f})  ms {by_round}")
        for name in names[1:]:
            if f"{name}_ops" in r:
                print(
                    f"\n  {name} against {names[0]}, self CPU ms per step by operator (median of {args.profile_ops} "
                    f"profiled steps in each process; pooled: the median difference, in how many processes above)"
                )
                for op in r[f"{name}_ops"][:PROFILE_ROWS]:
                    print(
                        f"  {op['op'][:56]:<56} {op['baseline_ms']:>9.1f} {op['ms']:>9.1f} {op['diff_ms']:>+9.1f}"
                        f"  {op['runs_above']}/{args.processes}"
                    )
    if result.get("train_memory"):
        print("\npeak memory of one training forward+backward (MiB, each in a fresh process)")
        print(f"{'model':>24} {'baseline':>24} {'res':>5} {'B':>2} {'model':>9} {'baseline':>9} {'ratio':>6}")
        for r in result["train_memory"]:
            print(
                f"{r['model']:>24} {r['baseline']:>24} {r['resolution']:>5} {r['batch']:>2} "
                f"{r['model_mib']:>9.0f} {r['baseline_mib']:>9.0f} {r['ratio']:>6.2f}"
            )


PROFILE_ROWS = 20  # operators printed per --profile-ops table (the JSON holds them all)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=positive_int, default=192)
    parser.add_argument("--grids", type=positive_int, nargs="*", default=[14, 28, 56], help="token grid sides S")
    parser.add_argument(
        "--batches", type=positive_int, nargs="*", default=[8, 2, 1], help="batch per grid (last repeats)"
    )
    parser.add_argument("--backward", action="store_true", help="also time forward+backward")
    parser.add_argument("--matmul", action="store_true", help="also time the matmul DFT backend")
    parser.add_argument("--growth", type=positive_int, nargs="*", default=[], help="grid sides for the cost-growth fit")
    parser.add_argument("--models-res", type=positive_int, nargs="*", default=[], help="whole-model resolutions")
    parser.add_argument(
        "--models-batches", type=positive_int, nargs="*", default=[1], help="batch per resolution (last repeats)"
    )
    parser.add_argument(
        "--train-res", type=positive_int, nargs="*", default=[], help="resolutions for whole training steps"
    )
    parser.add_argument("--train-batches", type=positive_int, nargs="*", default=[8, 2], help="batch per --train-res")
    parser.add_argument(
        "--train-models",
        nargs="*",
        default=[
            "deit_tiny_patch16_224",
            "ca_deit_tiny",
            "ca_deit_tiny+lean",
            "ca_deit_tiny+stored",
            "deit_tiny_patch16_224+converted",
        ],
        help="MODEL[+VARIANT] for --train-res, the first the baseline",
    )
    parser.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a model argument (YAML value) every --train-models and --memory-pairs model is built with, e.g. "
        "--model-arg depth=2; repeatable",
    )
    parser.add_argument(
        "--memory-res", type=positive_int, nargs="*", default=[], help="resolutions for the memory mode"
    )
    parser.add_argument(
        "--memory-pairs",
        nargs="*",
        default=["ca_deit_tiny:deit_tiny_patch16_224", "ca_pvt_tiny:pvt_tiny"],
        help="MODEL:BASELINE pairs for the memory mode",
    )
    parser.add_argument("--memory-batch", type=positive_int, default=1)
    parser.add_argument("--memory-worker", nargs=3, help=argparse.SUPPRESS)  # internal: MODEL RES BATCH
    parser.add_argument("--rounds", type=positive_int, default=7)
    parser.add_argument(
        "--pairs", type=int, default=0, help="training steps: also time single steps in this many pairs per model"
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=0,
        help="training steps: time the --pairs in this many fresh processes, each laid out anew in memory, "
        "and pool them (on CPU where a process's tensors land moves one model against another by a few %%); "
        "with --alone, the rounds of processes of one model each",
    )
    parser.add_argument(
        "--profile-ops",
        type=int,
        default=0,
        metavar="STEPS",
        help="training steps, with --processes (CPU): also profile this many steps of each model in every process "
        "and report where each model's time differs from the first's, operator by operator, pooled",
    )
    parser.add_argument(
        "--alone",
        type=int,
        default=0,
        metavar="STEPS",
        help="training steps, with --processes: also time this many steps of each model alone in a fresh process, "
        "in --processes rounds of one process per model, as a training run has its process to itself",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="training steps: every model through torch.compile, as compile=true trains (compiled before timing)",
    )
    parser.add_argument("--train-worker", help=argparse.SUPPRESS)  # internal: a JSON spec of train_pairs_worker
    parser.add_argument("--alone-worker", help=argparse.SUPPRESS)  # internal: a JSON spec of train_alone_worker
    parser.add_argument("--min-block", type=float, default=0.2, help="seconds per timed block")
    parser.add_argument(
        "--device", type=device_name, default="cpu", help="cpu or cuda (every module and input is made there)"
    )
    parser.add_argument(
        "--amp",
        choices=sorted(AMP_DTYPES),
        default=None,
        help="time under autocast (GEMMs in low precision; the FFTs stay fp32)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    parser.add_argument("--json-out", default=None, help="also write the results as JSON to this file")
    return parser


def check_models(args: argparse.Namespace) -> None:
    """Every model the run builds, at every resolution it builds it at, checked before any timing starts: an
    unknown model or variant, or a size a model cannot take, is one line (on the meta device: no compute)."""
    model_args = parse_model_args(args.model_arg)
    wanted = [(spec, args.train_res, model_args) for spec in args.train_models]
    wanted += [(name, args.models_res, {}) for name in ("ca_deit_tiny", "deit_tiny_patch16_224")]  # whole_models'
    wanted += [(spec, args.memory_res, model_args) for pair in args.memory_pairs for spec in pair.split(":")]
    for spec, sizes, kwargs in wanted:
        name, _ = split_variant(spec)
        for res in sizes:
            check_model_size(name, res, **kwargs)


def worker_job(args: argparse.Namespace) -> Callable[[], object] | None:
    """What this process prints when it is one of the tool's fresh worker processes (the internal --*-worker
    flags); None for the tool itself."""
    if args.memory_worker:
        model, res, batch = args.memory_worker
        return lambda: train_memory(model, int(res), int(batch), args.device, parse_model_args(args.model_arg))
    if args.train_worker:
        return lambda: json.dumps(train_pairs_worker(json.loads(args.train_worker), args.device))
    if args.alone_worker:
        return lambda: train_alone_worker(json.loads(args.alone_worker), args.device)
    return None


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.processes < 0 or (args.processes and not (args.pairs or args.alone)):
        parser.error(
            f"--processes {args.processes}: give a count of at least 1, with --pairs or --alone (what it runs)"
        )
    if args.profile_ops < 0 or (args.profile_ops and (not args.processes or args.device != "cpu")):
        parser.error(
            f"--profile-ops {args.profile_ops}: give a count of at least 1, with --processes, on the CPU (it pools "
            "CPU self times over the processes; one process's profile is not a comparison)"
        )
    if args.compile and not args.train_res:
        parser.error("--compile applies to training steps: give --train-res")
    if args.alone < 0 or (args.alone and not args.processes):
        parser.error(f"--alone {args.alone}: give a count of at least 1, with --processes (the rounds it runs)")
    job = worker_job(args)
    if job is None:
        check_models(args)
    with autocast_for(args.device, args.amp is not None, args.amp):
        if job is not None:
            print(job())
            return 0
        torch.set_default_device(args.device)
        result = measure(args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    report(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
