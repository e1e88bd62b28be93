#!/usr/bin/env python
"""The prepared CUDA check: mixed-precision correctness of circulant attention, the DFT each half precision takes on
this card, then CA-DeiT-T's speed against DeiT-T's, eager, compiled and compiled with CUDA graphs.

Meant for a short session on a lent GPU: one command, within --budget-s (8 minutes by default; what does not fit is
listed as skipped, the most telling cases measured first). Writes ``gpu_check.json`` and Fig. 4's
``fig4_efficiency.png`` into --out and exits non-zero if any autocast result is off (relative error against float32
>= 1e-2 for outputs, >= 5e-2 for the gradients).

    python tools/gpu_check.py --out results/        # on a CUDA machine

0. The default training step as a run makes it (compiled with CUDA graphs, bf16, fused AdamW), with accum_steps 1
   and 2: its time, host synchronisations per step, and what torch logged about CUDA graphs (skipped, partitioned).
1. Correctness: ``circulant_attention`` and ``CirculantAttention`` under ``torch.autocast`` with fp16 and bf16 on
   square, non-square and non-power-of-two grids, the module's input gradient too, and a whole CA-DeiT-T, with each
   DFT (``fft``: cuFFT in float32; ``separable``: GEMMs in the autocast dtype).
2. The DFT under half precision: a CA-DeiT-T training step at 224^2 B=64 and 1024^2 B=2 with each DFT, interleaved;
   the faster (geometric mean over both) is recorded for this card (:func:`cat.ops.policy.record_measured_backend`),
   and ``fft_backend=auto`` takes it from then on.
3. Speed: CA-DeiT-T through the Triton kernels and through ATen's operators against DeiT-T with SDPA and with its
   softmax as matrix products, training (forward, cross-entropy, backward, fused AdamW) at 224^2 B=64 and 1024^2
   B=2, inference at 224^2 B=8 and 1536^2 B=1, fp32 and bf16; compiled with CUDA graphs first (as a run trains),
   then eager, then compiled without CUDA graphs. The kernels' speed against ATen in the default training step is
   recorded for the card (``attention_kernel=auto`` reads it), and Fig. 4 is drawn from the compiled rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import timm
import torch

import cat  # noqa: F401  (registers cat's models with timm)
from cat.ops import CirculantAttention, circulant_attention, set_fft_backend
from cat.ops.policy import record_measured_backend
from cat.runtime import AMP_DTYPES, autocast_for, report_user_errors
from cat.runtime.io import atomic_write_text, refuse_planted
from cat.toolkit import interleaved_medians, positive_int
from cat.toolkit.cli import output_folder
from cat.toolkit.fig4 import MODELS as FIG4_MODELS
from cat.toolkit.fig4 import gflops, plot
from cat.toolkit.variants import build_variant, inference_variant, train_step_fns


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


# Largest relative error against float32 each check accepts: outputs, and the gradients of the
# lean backward (its GEMMs run in the autocast dtype, as autograd's would).
OUTPUT_TOLERANCE, GRADIENT_TOLERANCE = 1e-2, 5e-2


# The token grids the correctness check runs the operator on: the zoo's (224² and its stages), odd and non-square.
CORRECTNESS_GRIDS = ((14, 14), (7, 10), (28, 28), (56, 56), (24, 40))


def correctness(
    device: str, fft_backend: str = "auto", grids: tuple[tuple[int, int], ...] = CORRECTNESS_GRIDS
) -> list[dict[str, object]]:
    """Relative errors of fp16/bf16 autocast against float32 with the DFT backend ``fft_backend`` ('auto': what a
    model takes on ``device``; ``device`` may be 'cpu') on the token ``grids``, and of a whole CA-DeiT-T."""
    kind = torch.device(device).type
    rows = []
    torch.manual_seed(0)
    for hw in grids:
        q, k, v = torch.randn(3, 2, *hw, 64, device=device).unbind(0)
        ref = circulant_attention(q, k, v, head_dim=1, fft_backend="fft")
        attn = CirculantAttention(64, fft_backend="fft").to(device)
        x = torch.randn(2, hw[0] * hw[1], 64, device=device, requires_grad=True)
        module_ref = attn(x, hw)
        grad_ref = torch.autograd.grad(module_ref.square().sum(), x)[0]
        module_ref = module_ref.detach()
        set_fft_backend(attn, fft_backend)
        for name, dtype in AMP_DTYPES.items():
            with torch.autocast(kind, dtype=dtype):
                out = circulant_attention(q.to(dtype), k.to(dtype), v.to(dtype), fft_backend=fft_backend)
                module_out = attn(x, hw)
            grad = torch.autograd.grad(module_out.float().square().sum(), x)[0]
            module_out = module_out.detach()
            rows.append(
                {
                    "what": "circulant_attention",
                    "hw": list(hw),
                    "dtype": name,
                    "out_dtype": str(out.dtype),
                    "rel_err": relative_error(out, ref),
                    "tolerance": OUTPUT_TOLERANCE,
                }
            )
            rows.append(
                {
                    "what": "CirculantAttention",
                    "hw": list(hw),
                    "dtype": name,
                    "out_dtype": str(module_out.dtype),
                    "rel_err": relative_error(module_out, module_ref),
                    "tolerance": OUTPUT_TOLERANCE,
                }
            )
            rows.append(
                {
                    "what": "CirculantAttention grad",
                    "hw": list(hw),
                    "dtype": name,
                    "out_dtype": str(grad.dtype),
                    "rel_err": relative_error(grad, grad_ref),
                    "tolerance": GRADIENT_TOLERANCE,
                }
            )
    model = set_fft_backend(timm.create_model("ca_deit_tiny"), "fft").to(device).eval()
    images = torch.randn(4, 3, 224, 224, device=device)
    with torch.no_grad():
        logits = model(images)
        set_fft_backend(model, fft_backend)
        for name, dtype in AMP_DTYPES.items():
            with torch.autocast(kind, dtype=dtype):
                rows.append(
                    {
                        "what": "ca_deit_tiny logits",
                        "hw": [224, 224],
                        "dtype": name,
                        "out_dtype": str(dtype),
                        "rel_err": relative_error(model(images), logits),
                        "tolerance": OUTPUT_TOLERANCE,
                    }
                )
    return rows


# Fig. 4's models, CA-DeiT-T's attention as the Triton kernels and as ATen's operators.
MODELS = {
    "CA-DeiT-T": "ca_deit_tiny+triton",
    "CA-DeiT-T (ATen)": "ca_deit_tiny+aten",
    **{label: spec for label, spec in FIG4_MODELS.items() if label != "CA-DeiT-T"},
}
# (what, resolution, batch), in the order of their priority within a compile mode.
CASES = (("train", 224, 64), ("infer", 1536, 1), ("train", 1024, 2), ("infer", 224, 8))
COMPILED_CASES = CASES  # the targets' cases, compiled with CUDA graphs as a run is
DFT_CASES = ((224, 64), (1024, 2))


def step_fns(
    specs: dict[str, str], what: str, res: int, batch: int, device: str, dtype: str, mode: str | None
) -> dict[str, Callable[[], None]]:
    """One training step or one inference call of each model (``mode`` None: eager, else torch.compile's mode)."""
    autocast = lambda: autocast_for(device, dtype != "fp32", None if dtype == "fp32" else dtype)
    if what == "train":
        steps = train_step_fns(
            list(specs.values()), res, batch, device, mode is not None, {}, autocast, mode or "default"
        )
        return {label: steps[spec] for label, spec in specs.items()}
    x = torch.randn(batch, 3, res, res, device=device)
    fns = {}
    for label, spec in specs.items():
        model = inference_variant(spec, res, device, {})
        forward = torch.compile(model, mode=mode) if mode is not None else model

        def infer(forward=forward) -> None:
            with torch.inference_mode(), autocast():
                forward(x)

        fns[label] = infer
    return fns


def timed(fns: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median seconds per call, interleaved, after three calls each (compilation, CUDA graphs' recording)."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    return interleaved_medians(fns, rounds, 0.1)


def dft_choice(device: str, card: str, rounds: int) -> dict[str, dict[str, object]]:
    """For bf16 and fp16: CA-DeiT-T's training step with cuFFT in float32 and with the separable GEMM DFT, and the
    faster of the two (geometric mean of the ratios over :data:`DFT_CASES`), recorded for ``card``."""
    result = {}
    for dtype in ("bf16", "fp16"):
        ratios, rows = [], {}
        for res, batch in DFT_CASES:
            specs = {name: f"ca_deit_tiny+{name}" for name in ("fft", "separable")}
            seconds = timed(step_fns(specs, "train", res, batch, device, dtype, None), rounds)
            rows[f"{res}x{batch}"] = {name: s * 1e3 for name, s in seconds.items()}
            ratios.append(seconds["separable"] / seconds["fft"])
        ratio = math.prod(ratios) ** (1 / len(ratios))
        choice = "separable" if ratio < 1 else "fft"
        recorded = _recorded(record_measured_backend, card, str(AMP_DTYPES[dtype]).removeprefix("torch."), choice)
        result[dtype] = {"step_ms": rows, "separable_over_fft": ratio, "choice": choice, "recorded": recorded}
        print(f"DFT under {dtype}: separable / fft step time {ratio:.2f} (geometric mean) -> {choice}, {recorded}")
    return result


def speed(device: str, rounds: int, deadline: float) -> tuple[list[dict[str, object]], list[str]]:
    """The speed matrix, eager first, then compiled cases, each row CA-DeiT-T's against the baselines; what the
    ``deadline`` (time.monotonic) leaves out is named in the second list."""
    plan = [("reduce-overhead", case, dtype) for dtype in ("bf16", "fp32") for case in COMPILED_CASES]
    plan += [(None, case, dtype) for dtype in ("fp32", "bf16") for case in CASES]
    plan += [("default", case, dtype) for case in COMPILED_CASES[:2] for dtype in ("bf16", "fp32")]
    rows, skipped = [], []
    for mode, (what, res, batch), dtype in plan:
        name = f"{what} {res}^2 B={batch} {dtype} {mode or 'eager'}"
        if time.monotonic() > deadline:
            skipped.append(name)
            continue
        seconds = timed(step_fns(MODELS, what, res, batch, device, dtype, mode), rounds)
        torch._dynamo.reset()
        base = seconds["CA-DeiT-T"]
        row = {"what": what, "res": res, "batch": batch, "dtype": dtype, "mode": mode or "eager"}
        row |= {f"{label} ms": s * 1e3 for label, s in seconds.items()}
        row |= {f"speed vs {label}": s / base for label, s in seconds.items() if label != "CA-DeiT-T"}
        rows.append(row)
        print(
            f"{name:>40}: CA-DeiT-T {base * 1e3:8.2f} ms; speed against SDPA {row['speed vs DeiT-T (SDPA)']:.2f}x, "
            f"against matmul softmax {row['speed vs DeiT-T (matmul)']:.2f}x, against its ATen path "
            f"{row['speed vs CA-DeiT-T (ATen)']:.2f}x",
            flush=True,
        )
    return rows, skipped


def run_config(*overrides: str):
    """The classification config ``train_cls.py`` runs with ``overrides`` (its defaults: compile=auto,
    compile_mode=auto, amp=auto, fused AdamW on CUDA), typed as a run hands it to its components."""
    from hydra import compose, initialize_config_dir

    from cat.runtime.schema import schema_of, typed_config

    configs = Path(__file__).resolve().parent.parent / "configs" / "cls"
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        return typed_config(compose(config_name="config", overrides=list(overrides)), schema_of("cls"))


class _Captured(logging.Handler):
    """torch's log lines about CUDA graphs (skipped, partitioned), as they are emitted."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "cudagraph" in message.lower() or "cuda graph" in message.lower():
            self.lines.append(message)


def default_steps(device: str, steps: int = 6) -> list[dict[str, object]]:
    """CA-DeiT-T's training step at 224^2 as a user's run makes it, for ``accum_steps`` 1 and 2 (64 images a step):
    the run's compile plan (compiled, CUDA graphs), bf16 autocast, fused AdamW, stable gradient buffers where the plan
    keeps them, the loop's own step with its checks a step late. Reports the median step time, whether CUDA graphs
    were skipped or partitioned (torch's log and counters) and the host reads per step (sync debug mode)."""
    from timm.scheduler import create_scheduler_v2
    from torch._dynamo.utils import counters

    from cat.classification.loops import StepChecks, TrainOptions, skips_on_device, train_step
    from cat.classification.model_building import compile_plan, compiled
    from cat.classification.optimization import step_kwargs
    from cat.classification.state import TrainState
    from cat.runtime import Precision

    rows = []
    for accum in (1, 2):
        cfg = run_config(f"accum_steps={accum}")
        plan = compile_plan(cfg, torch.device(device))
        precision = Precision.from_config(cfg.amp, torch.device(device))
        model = build_variant("ca_deit_tiny", 224, device, {})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **step_kwargs("adamw", torch.device(device), {}))
        schedule, _ = create_scheduler_v2(optimizer, sched="constant", num_epochs=1, updates_per_epoch=steps)
        state = TrainState(model, optimizer, schedule, precision.grad_scaler())
        state.train_model, state.stable_grads = compiled(plan, model), plan.stable_grads
        opts = TrainOptions(precision=precision, steps_per_epoch=steps * 2, accum_steps=accum)
        checks = StepChecks(deferred=skips_on_device(optimizer))
        batch = 64 // accum
        micro = [(torch.randn(batch, 3, 224, 224), torch.randint(0, 1000, (batch,))) for _ in range(accum)]
        captured = _Captured()
        torch_log = logging.getLogger("torch")
        torch_log.addHandler(captured)
        counters.clear()
        try:
            for _ in range(3):  # compilation and the CUDA graphs' recording
                train_step(state, micro, opts, checks)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            times = []
            with warnings.catch_warnings(record=True) as syncs:
                warnings.simplefilter("always")
                for _ in range(steps):
                    start = time.perf_counter()
                    train_step(state, micro, opts, checks)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
            torch.cuda.set_sync_debug_mode("default")
            checks.earlier()
        finally:
            torch_log.removeHandler(captured)
        inductor = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k or "partition" in k}
        row = {
            "accum_steps": accum,
            "plan": plan.line(),
            "precision": f"{precision.dtype} autocast" if precision.amp else "float32",
            "step_ms": statistics.median(times) * 1e3,
            "host_syncs_per_step": sum("synchroniz" in str(w.message) for w in syncs) / steps,
            "cudagraph_log": captured.lines[:20],
            "inductor_counters": inductor,
            "graphs": counters["stats"].get("unique_graphs", 0),
        }
        rows.append(row)
        print(
            f"default step, accum_steps={accum}: {row['step_ms']:.2f} ms, {row['host_syncs_per_step']:.1f} host "
            f"syncs a step, CUDA-graph lines {len(captured.lines)}, counters {inductor}",
            flush=True,
        )
        torch._dynamo.reset()
    return rows


def _recorded(record: Callable[..., Path], *args: str) -> str:
    """Where ``record(*args)`` wrote a measured choice, or why it could not (the measurement stays in
    gpu_check.json)."""
    try:
        return f"recorded in {record(*args)}"
    except OSError as error:
        return f"not recorded: {error.strerror or error}"


def kernel_choice(rows: list[dict[str, object]], card: str) -> dict[str, object] | None:
    """The kernels against the ATen path in the default training step (224^2, B=64, bf16, CUDA graphs): the faster
    recorded for ``card`` (:func:`cat.ops.policy.record_measured_kernel`), which ``attention_kernel=auto`` reads."""
    from cat.ops.policy import record_measured_kernel

    for row in rows:
        if (row["what"], row["res"], row["dtype"], row["mode"]) == ("train", 224, "bf16", "reduce-overhead"):
            ratio = float(row["speed vs CA-DeiT-T (ATen)"])  # the ATen step's time over the kernels'
            choice = "triton" if ratio >= 1 else "aten"
            recorded = _recorded(record_measured_kernel, card, choice)
            print(f"attention kernel: the Triton kernels {ratio:.2f}x the ATen path's speed -> {choice}, {recorded}")
            return {"kernels_speed_over_aten": ratio, "choice": choice, "recorded": recorded}
    return None


def figure(rows: list[dict[str, object]], out: Path, card: str) -> None:
    """Fig. 4 (a, b) from the compiled inference rows (CUDA graphs; the eager ones where none were measured): FLOPs
    and images/s over resolution, CA-DeiT-T through the kernels and through ATen beside DeiT-T's SDPA and the paper's
    matmul softmax."""
    infer = [r for r in rows if r["what"] == "infer" and r["mode"] == "reduce-overhead"]
    infer = infer or [r for r in rows if r["what"] == "infer" and r["mode"] == "eager"]
    resolutions = sorted({int(r["res"]) for r in infer})
    result: dict[str, object] = {
        "device": card,
        "resolutions": resolutions,
        "gflops": {label: {str(res): gflops(spec, res) for res in resolutions} for label, spec in MODELS.items()},
        "speed": {
            dtype: {
                str(r["res"]): {label: {"infer_img_s": r["batch"] / (r[f"{label} ms"] / 1e3)} for label in MODELS}
                for r in infer
                if r["dtype"] == dtype
            }
            for dtype in ("fp32", "bf16")
        },
        "families": [],
    }
    if resolutions:
        plot(result, out)


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip-bench", action="store_true", help="correctness only")
    parser.add_argument("--budget-s", type=positive_int, default=480, help="seconds for the whole check (default 480)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds per median")
    args = parser.parse_args(argv)
    started = time.monotonic()
    out = output_folder(args.out)
    for output in ("gpu_check.json", "fig4_efficiency.png", "fig4_efficiency.pdf"):  # refused before any measuring
        refuse_planted(str(out / output))
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; run this on a GPU machine", file=sys.stderr)
        return 2
    card = torch.cuda.get_device_name()
    result: dict[str, object] = {
        "device": card,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "correctness": [row | {"dft": dft} for dft in ("fft", "separable") for row in correctness("cuda", dft)],
    }
    for row in result["correctness"]:
        print(
            f"{row['what']:>22} {str(row['hw']):>10} {row['dtype']} {row['dft']:>9}: rel err {row['rel_err']:.2e} "
            f"({row['out_dtype']})"
        )
    if not args.skip_bench:
        torch.backends.cuda.matmul.allow_tf32 = True  # as a run's default amp.tf32=true
        torch.backends.cudnn.allow_tf32 = True
        result["default_steps"] = default_steps("cuda")
        result["dft_choice"] = dft_choice("cuda", card, args.rounds)
        result["speed"], result["skipped"] = speed("cuda", args.rounds, started + args.budget_s)
        result["kernel_choice"] = kernel_choice(result["speed"], card)
        figure(result["speed"], out, card)
    atomic_write_text(str(out / "gpu_check.json"), json.dumps(result, indent=2))  # never through a planted link
    bad = [r for r in result["correctness"] if r["rel_err"] >= r["tolerance"]]
    elapsed = time.monotonic() - started
    print(f"wrote {out / 'gpu_check.json'} in {elapsed:.0f} s; {len(bad)} autocast results beyond their tolerance")
    if result.get("skipped"):
        print(f"skipped for the budget: {', '.join(result['skipped'])}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
