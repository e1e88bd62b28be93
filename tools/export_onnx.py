#!/usr/bin/env python
"""Export a circulant-attention model to ONNX and check onnxruntime against torch.

ONNX has no complex dtypes and no FFT the runtimes agree on, so the model is switched to the
matmul DFT backend (``cat.ops.set_fft_backend(model, 'matmul')``): its 2-D DFTs become real
matrix products, identical in value to torch.fft (to float rounding).

    python tools/export_onnx.py --out ca_deit_tiny.onnx
    python tools/export_onnx.py --model ca_deit_small --checkpoint ca_deit_s.pth --img-size 224 --out ca_deit_s.onnx
"""

from __future__ import annotations

import argparse
import sys
import warnings

import numpy as np
import torch

import cat
from cat.ops import set_fft_backend
from cat.runtime import report_user_errors


def export(model: torch.nn.Module, img_size: int, path: str, batch: int = 1) -> None:
    x = torch.randn(batch, 3, img_size, img_size)
    # The TorchScript-based exporter (the dynamo one needs onnxscript and gains nothing here). The
    # graph is traced at img_size: its grid-size arithmetic becomes constants, which is intended.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(
            model,
            (x,),
            path,
            dynamo=False,
            input_names=["images"],
            output_names=["logits"],
            opset_version=17,
            dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}},
        )


def check(model: torch.nn.Module, path: str, img_size: int, batch: int = 2) -> float:
    """Max relative difference between onnxruntime and torch on random images."""
    import onnxruntime as ort

    x = torch.randn(batch, 3, img_size, img_size)
    with torch.no_grad():
        expected = model(x).numpy()
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {"images": x.numpy()})[0]
    return float(np.abs(got - expected).max() / np.abs(expected).max())


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the .onnx file to write")
    parser.add_argument("--model", default="ca_deit_tiny")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max relative difference accepted")
    args = parser.parse_args(argv)

    model = cat.create_model(args.model, checkpoint=args.checkpoint, img_size=args.img_size).eval()
    set_fft_backend(model, "matmul")
    export(model, args.img_size, args.out)
    error = check(model, args.out, args.img_size)
    print(f"exported {args.model} to {args.out}; onnxruntime vs torch: max relative difference {error:.2e}")
    if error > args.tolerance:
        print(f"FAILED: above the tolerance {args.tolerance:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
