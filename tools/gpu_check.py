#!/usr/bin/env python
"""The prepared CUDA check: mixed-precision correctness of circulant attention, then GPU speed.

Meant for a short session on a lent GPU: it needs nothing but this checkout's environment and
finishes in a few minutes. It writes ``gpu_check.json`` into --out and exits non-zero if any
autocast result is off (relative error against float32 >= 1e-2 for outputs, >= 5e-2 for the
gradients of the lean backward).

    python tools/gpu_check.py --out results/        # on a CUDA machine

Checks: ``circulant_attention`` and ``CirculantAttention`` under ``torch.autocast`` with fp16 and
bf16 (cuFFT rejects half precision for non-power-of-two grids, so the FFTs must stay fp32) on
square, non-square and non-power-of-two grids, the module's input gradient too; a whole CA-DeiT-T;
then ``tools/bench_attention.py`` on the GPU in fp32 and bf16 (the released pipeline, SDPA and
GEMM-floor ratios, growth exponent, CA-DeiT-T vs DeiT-T at 224^2 (batch 8) and 1536^2, whole training
steps of DeiT-T, CA-DeiT-T (auto, lean, autograd) and the converted DeiT-T at 224^2/512^2/1024^2, and the
training-memory ratios at 1024^2 and 2048^2).
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
from cat.ops import CirculantAttention, circulant_attention
from cat.runtime import AMP_DTYPES, report_user_errors


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


# Largest relative error against float32 each check accepts: outputs, and the gradients of the
# lean backward (its GEMMs run in the autocast dtype, as autograd's would).
OUTPUT_TOLERANCE, GRADIENT_TOLERANCE = 1e-2, 5e-2


def correctness(device: str) -> list[dict[str, object]]:
    """Relative errors of fp16/bf16 autocast against float32 (``device`` may be 'cpu' for a dry run)."""
    kind = torch.device(device).type
    rows = []
    torch.manual_seed(0)
    for hw in ((14, 14), (7, 10), (28, 28), (56, 56), (24, 40)):
        q, k, v = torch.randn(3, 2, *hw, 64, device=device).unbind(0)
        ref = circulant_attention(q, k, v, head_dim=1)
        attn = CirculantAttention(64).to(device)
        x = torch.randn(2, hw[0] * hw[1], 64, device=device, requires_grad=True)
        module_ref = attn(x, hw)
        grad_ref = torch.autograd.grad(module_ref.square().sum(), x)[0]
        module_ref = module_ref.detach()
        for name, dtype in AMP_DTYPES.items():
            with torch.autocast(kind, dtype=dtype):
                out = circulant_attention(q.to(dtype), k.to(dtype), v.to(dtype))
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
    model = timm.create_model("ca_deit_tiny").to(device).eval()
    images = torch.randn(4, 3, 224, 224, device=device)
    with torch.no_grad():
        logits = model(images)
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
        common = [
            "--device",
            "cuda",
            "--backward",
            "--matmul",
            "--growth",
            "28",
            "48",
            "64",
            "96",
            "128",
            "--models-res",
            "224",
            "1536",
            "--models-batches",
            "8",
            "1",
            "--train-res",
            "224",
            "512",
            "1024",
            "--train-batches",
            "64",
            "16",
            "2",
            "--memory-res",
            "1024",
            "2048",
            "--rounds",
            "9",
            "--min-block",
            "0.1",
        ]
        for amp in (None, "bf16"):
            bench_json = out / f"bench_{amp or 'fp32'}.json"
            subprocess.run(
                [
                    sys.executable,
                    str(Path(__file__).with_name("bench_attention.py")),
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
