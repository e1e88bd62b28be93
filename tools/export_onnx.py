#!/usr/bin/env python
"""Export a model to ONNX and check onnxruntime against torch.

Both ways go through torch's default exporter (torch.export and onnxscript); they differ in how the
FFTs are carried:
  dft     (default) as ONNX DFT; the graph takes any batch and any resolution (multiples of the output
          stride), checked at two resolutions (a model built for one size, as timm's ViTs are: that size).
  matmul  the model is switched to the matmul DFT backend (``cat.ops.set_fft_backend(model,
          'matmul')``): real matrix products, for runtimes without DFT; any batch, fixed to --img-size.

    python tools/export_onnx.py --out ca_deit_tiny.onnx
    python tools/export_onnx.py --model ca_deit_small --checkpoint ca_deit_s.pth --out ca_deit_s.onnx
    python tools/export_onnx.py --backend matmul --img-size 224 --out ca_deit_tiny_224.onnx
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

import cat
import cat.export
from cat.ops import set_fft_backend
from cat.runtime import report_user_errors
from cat.toolkit import add_model_arguments, model_from_args


def check(model: torch.nn.Module, path: str, size: tuple[int, int], batch: int = 2) -> float:
    """Max relative difference between onnxruntime and torch on random images of ``size``."""
    import onnxruntime as ort

    x = torch.randn(batch, 3, *size)
    with torch.no_grad():
        expected = model(x).numpy()
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    return float(np.abs(got - expected).max() / np.abs(expected).max())


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the .onnx file to write")
    add_model_arguments(parser, "ca_deit_tiny", "the model to export")
    parser.add_argument("--backend", choices=("dft", "matmul"), default="dft")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max relative difference accepted")
    args = parser.parse_args(argv)

    model = model_from_args(args)  # --img-size: the example's size (matmul: the only one)
    size = (args.img_size, args.img_size)
    if args.backend == "matmul":
        set_fft_backend(model, "matmul")  # its DFT matrices are built for one grid: the export's size only
        # The lowest opset torch's exporter writes, for the older runtimes this backend is for (DFT needs 20).
        cat.export.export_onnx(model, torch.randn(2, 3, *size), args.out, opset=18, dynamic_size=False)
        sizes = [size]
    elif not cat.export.takes_any_size(model):
        print(
            f"{args.model} takes {args.img_size}x{args.img_size} only "
            "(--model-arg dynamic_img_size=true builds it for other sizes)"
        )
        cat.export.export_onnx(model, torch.randn(2, 3, *size), args.out, dynamic_size=False)
        sizes = [size]
    else:
        cat.export.export_onnx(model, torch.randn(2, 3, *size), args.out)
        step = cat.export.output_stride(model)
        sizes = [size, (args.img_size + 2 * step, args.img_size + step)]  # and a second, non-square one
    errors = [check(model, args.out, s) for s in sizes]
    shown = ", ".join(f"{h}x{w} {e:.2e}" for (h, w), e in zip(sizes, errors, strict=True))
    print(f"exported {args.model} to {args.out} ({args.backend}); onnxruntime vs torch, max relative difference:")
    print(f"  {shown}")
    if max(errors) > args.tolerance:
        print(f"FAILED: above the tolerance {args.tolerance:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
