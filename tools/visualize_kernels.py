#!/usr/bin/env python
"""Equivalent global convolution kernels of a circulant-attention model (the paper's Fig. 5).

A circulant attention map is a circular convolution, so for each layer and channel (head) the
softmax weights over the H x W offsets *are* a global kernel, computed afresh for every image.
This tool runs one image through a CA model, takes each layer's weights, centres them with
``fftshift`` (offset 0 in the middle) and saves them as a grid: rows are layers, columns channels.

    python tools/visualize_kernels.py --out runs/kernels                                 # random CA-DeiT-T
    python tools/visualize_kernels.py --model ca_deit_small --checkpoint ca_deit_s.pth \
        --image dog.jpg --out runs/kernels

Writes ``kernels.png/.pdf`` and ``kernels.json`` (per layer: how much weight lies within the 3x3
and 7x7 neighbourhoods of offset 0, a locality measure).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import Tensor

from cat.errors import ConfigError
from cat.models.convert import PluginCirculantAttention
from cat.ops import CirculantAttention
from cat.runtime import report_user_errors
from cat.toolkit import load_images, model_from_args, model_tool_parser, sample_images, save_figure, to_model_input


def capture_kernels(model: torch.nn.Module, x: Tensor) -> list[Tensor]:
    """Per circulant-attention layer, the centred kernels (heads, H, W) of the first image."""
    layers = [m for m in model.modules() if isinstance(m, (CirculantAttention, PluginCirculantAttention))]
    if not layers:
        raise ConfigError(
            f"{type(model).__name__} has no circulant-attention layers (a softmax model's maps: tools/bccb_analysis.py)"
        )
    for layer in layers:
        layer.keep_weights = True
    try:
        with torch.no_grad():
            model(x)
        kernels = [torch.fft.fftshift(layer.last_weights[0], dim=(-2, -1)) for layer in layers]
    finally:
        for layer in layers:
            layer.keep_weights, layer.last_weights = False, None
    return kernels


def neighbourhood_mass(kernel: Tensor, radius: int) -> float:
    """Mean over heads of the weight within +-radius of offset 0 (the centre after fftshift)."""
    H, W = kernel.shape[-2:]
    cy, cx = H // 2, W // 2
    window = kernel[:, max(cy - radius, 0) : cy + radius + 1, max(cx - radius, 0) : cx + radius + 1]
    return window.sum(dim=(-2, -1)).mean().item()


def plot_kernels(kernels: list[Tensor], channels: int, out: Path) -> None:
    import matplotlib.pyplot as plt

    cols = min(channels, kernels[0].shape[0])
    fig, axes = plt.subplots(len(kernels), cols, figsize=(1.1 * cols, 1.1 * len(kernels)), squeeze=False)
    for row, kernel in enumerate(kernels):
        for col in range(cols):
            ax = axes[row][col]
            ax.imshow(kernel[col].numpy(), cmap="inferno")
            ax.set_xticks([]), ax.set_yticks([])
            if col == 0:
                ax.set_ylabel(f"layer {row}", fontsize=7)
            if row == 0:
                ax.set_title(f"ch {col}", fontsize=7)
    fig.suptitle("equivalent global kernels (softmax weights over offsets, centred)", fontsize=9)
    save_figure(fig, out, "kernels")


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = model_tool_parser(
        __doc__, "folder for kernels.png/.pdf and kernels.json", "ca_deit_tiny", "a model with circulant attention"
    )
    parser.add_argument("--image", default=None, help="image file (default: scikit-image's cat photo)")
    parser.add_argument("--channels", type=int, default=12, help="channels (heads) shown per layer")
    args = parser.parse_args(argv)

    model = model_from_args(args)
    image = load_images(args.image, 1) if args.image else sample_images(("chelsea",))
    x = to_model_input(image, model, args.img_size)
    kernels = capture_kernels(model, x)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_kernels(kernels, args.channels, out)
    summary = {
        "model": args.model,
        "checkpoint": args.checkpoint,
        "image": args.image or "skimage.data.chelsea",
        "layers": [
            {
                "layer": i,
                "grid": list(k.shape[-2:]),
                "mass_3x3": neighbourhood_mass(k, 1),
                "mass_7x7": neighbourhood_mass(k, 3),
                "uniform_3x3": 9 / k[0].numel(),
            }
            for i, k in enumerate(kernels)
        ],
    }
    (out / "kernels.json").write_text(json.dumps(summary, indent=2))
    print(
        f"{len(kernels)} layers of {kernels[0].shape[0]} kernels on a "
        f"{kernels[0].shape[1]}x{kernels[0].shape[2]} grid; "
        f"wrote {out / 'kernels.png'} and {out / 'kernels.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
