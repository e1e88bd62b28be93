#!/usr/bin/env python
"""The prepared CUDA check: mixed-precision correctness of circulant attention, then GPU speed.

Meant for a short session on a lent GPU: it needs nothing but this checkout's environment and
finishes in a few minutes. It writes ``gpu_check.json`` into --out and exits non-zero if any
autocast result is off (relative error against float32 >= 1e-2 for outputs, >= 5e-2 for the
gradients of the lean backward).

    python tools/gpu_check.py --out results/        # on a CUDA machine

Checks: ``circulant_attention`` and ``CirculantAttention`` under ``torch.autocast`` with fp16 and
bf16 on square, non-square and non-power-of-two grids, the module's input gradient too, and a whole
CA-DeiT-T, with the DFTs ``auto`` takes on CUDA (the separable GEMMs in half precision); then the
paper's Fig. 4 on the card (``tools/benchmark.py``: CA-DeiT-T against DeiT-T with SDPA and with
matmul softmax, 224^2 to 1536^2, fp32 and bf16, kernels per step, the families' trade-off), and
``tools/bench_attention.py``'s whole training steps (auto, lean, stored) at 224^2 and 1024^2 with the
training memory at 1024^2, in fp32 and bf16.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import timm
import torch

import cat  # noqa: F401  (registers cat's models with timm)
from cat.ops import CirculantAttention, circulant_attention, set_fft_backend
from cat.runtime import AMP_DTYPES, report_user_errors


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


# Largest relative error against float32 each check accepts: outputs, and the gradients of the
# lean backward (its GEMMs run in the autocast dtype, as autograd's would).
OUTPUT_TOLERANCE, GRADIENT_TOLERANCE = 1e-2, 5e-2


def correctness(device: str, fft_backend: str = "auto") -> list[dict[str, object]]:
    """Relative errors of fp16/bf16 autocast against float32 with the DFT backend ``fft_backend`` ('auto': what a
    model takes on ``device``, the separable GEMMs on CUDA; ``device`` may be 'cpu')."""
    kind = torch.device(device).type
    rows = []
    torch.manual_seed(0)
    for hw in ((14, 14), (7, 10), (28, 28), (56, 56), (24, 40)):
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


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip-bench", action="store_true", help="correctness only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; run this on a GPU machine", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "correctness": correctness("cuda"),
    }
    for row in result["correctness"]:
        print(
            f"{row['what']:>22} {str(row['hw']):>10} {row['dtype']}: rel err {row['rel_err']:.2e} ({row['out_dtype']})"
        )
    if not args.skip_bench:
        tools = Path(__file__).parent
        # The paper's Fig. 4 on this card: FLOPs, inference and training speed of CA-DeiT-T against DeiT-T with SDPA
        # and with matmul softmax, 224^2 to 1536^2, fp32 and bf16, the families' trade-off (tools/benchmark.py).
        subprocess.run(
            [sys.executable, str(tools / "benchmark.py"), "--device", "cuda", "--out", str(out / "fig4")], check=True
        )
        result["fig4"] = json.loads((out / "fig4" / "benchmark.json").read_text())
        # Training steps under each policy, and training memory against the softmax baselines.
        common = ["--device", "cuda", "--grids", "--train-res", "224", "1024", "--train-batches", "64", "2"]
        common += ["--train-models", "deit_tiny_patch16_224", "ca_deit_tiny", "ca_deit_tiny+lean"]
        common += ["ca_deit_tiny+stored", "deit_tiny_patch16_224+matmul", "--memory-res", "1024", "--rounds", "7"]
        for amp in (None, "bf16"):
            bench_json = out / f"bench_{amp or 'fp32'}.json"
            subprocess.run(
                [
                    sys.executable,
                    str(tools / "bench_attention.py"),
                    *common,
                    *(["--amp", amp] if amp else []),
                    "--json-out",
                    str(bench_json),
                ],
                check=True,
            )
            result[f"bench_{amp or 'fp32'}"] = json.loads(bench_json.read_text())
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2))
    bad = [r for r in result["correctness"] if r["rel_err"] >= r["tolerance"]]
    print(f"wrote {out / 'gpu_check.json'}; {len(bad)} autocast results beyond their tolerance")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
