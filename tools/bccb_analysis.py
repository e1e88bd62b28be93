#!/usr/bin/env python
"""How close are a ViT's softmax attention maps to BCCB matrices? (the paper's Fig. 2/3 observation)

Hooks the attention maps of a timm ViT-style model (softmax attention, e.g. DeiT), projects each
N x N map (class tokens excluded) onto the BCCB matrices of the token grid with
``cat.ops.bccb_project`` and reports the relative distance ||A - P(A)|| / ||A|| per layer and head,
beside two references computed the same way: a random row-stochastic matrix, and the same map with
its tokens randomly permuted (same values, spatial structure destroyed). A centred variant divides
by ||A - mean(A)|| instead, since a near-uniform map (as in an untrained model) is trivially BCCB.

    python tools/bccb_analysis.py --out runs/bccb                       # DeiT-T, skimage's sample images
    python tools/bccb_analysis.py --model deit_small_patch16_224 --checkpoint deit_s.pth \
        --images photos/ --out runs/bccb

Writes ``bccb.json`` (every number), ``fig2_attention_maps.png/.pdf`` (a layer's maps with the
H x H block grid, beside their BCCB projections) and ``fig3_neighbour_queries.png/.pdf`` (the
attention of neighbouring queries, which a BCCB map makes shifted copies of one another).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from timm.layers import Attention
from torch import Tensor

from cat.errors import ConfigError
from cat.ops import bccb_project
from cat.runtime import report_user_errors
from cat.toolkit import load_images, model_from_args, model_tool_parser, positive_int, save_figure, to_model_input


def capture_attention(model: torch.nn.Module, x: Tensor) -> list[Tensor]:
    """Softmax attention maps (B, heads, N, N) of every timm ``Attention`` layer, in order."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise ConfigError(
            f"{type(model).__name__} has no timm softmax Attention layers to analyse (a circulant model's kernels: "
            "tools/visualize_kernels.py)"
        )
    maps: list[Tensor] = []
    hooks = []
    for layer in layers:
        layer.fused_attn = False  # the unfused path materialises the map, which attn_drop receives
        hooks.append(layer.attn_drop.register_forward_hook(lambda mod, args, out: maps.append(args[0].detach())))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return maps


def relative_distance(a: Tensor, hw: tuple[int, int], centred: bool = False) -> Tensor:
    """||A - P(A)||_F / ||A||_F over the last two dims.

    ``centred`` divides by ||A - mean(A)|| instead: the constant matrix is BCCB, so near-uniform
    maps (an untrained model's) are trivially close to BCCB by the plain measure; the centred one
    asks how much of the map's structure is BCCB.
    """
    residual = (a - bccb_project(a, hw)).flatten(-2).norm(dim=-1)
    reference = (a - a.mean(dim=(-1, -2), keepdim=True)) if centred else a
    return residual / reference.flatten(-2).norm(dim=-1)


def random_stochastic(shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    r = torch.rand(shape, generator=generator, dtype=torch.float64)
    return r / r.sum(-1, keepdim=True)


def analyse(maps: list[Tensor], hw: tuple[int, int], prefix: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    n = hw[0] * hw[1]
    results = []
    for index, attn in enumerate(maps):
        a = attn[:, :, prefix:, prefix:].double()  # (B, heads, N, N), class tokens excluded
        if a.shape[-1] != n:
            raise ValueError(f"layer {index}: {a.shape[-1]} patch tokens, but the grid {hw} has {n}")
        perm = torch.randperm(n, generator=g)
        permuted = a[..., perm, :][..., perm]
        heads = []
        for h in range(a.shape[1]):
            rand = random_stochastic(tuple(a[:, h].shape), g)
            heads.append(
                {"head": h}
                | {
                    f"{name}{suffix}": relative_distance(m, hw, centred).mean().item()
                    for name, m in (("distance", a[:, h]), ("permuted", permuted[:, h]), ("random_stochastic", rand))
                    for suffix, centred in (("", False), ("_centred", True))
                }
            )
        results.append(
            {"layer": index, "heads": heads}
            | {f"mean_{key}": float(np.mean([h[key] for h in heads])) for key in heads[0] if key != "head"}
        )
    return results


def plot_maps(maps: list[Tensor], layer: int, hw: tuple[int, int], prefix: int, out: Path, max_heads: int = 3) -> None:
    import matplotlib.pyplot as plt

    a = maps[layer][0, :, prefix:, prefix:].double()
    heads = min(max_heads, a.shape[0])
    fig, axes = plt.subplots(2, heads, figsize=(3.2 * heads, 6.4), squeeze=False)
    for h in range(heads):
        for row, (m, title) in enumerate(((a[h], "attention"), (bccb_project(a[h], hw), "BCCB projection"))):
            ax = axes[row][h]
            ax.imshow(m.numpy(), cmap="viridis")
            for k in range(1, hw[0]):  # the H x H grid of W x W blocks
                ax.axhline(k * hw[1] - 0.5, color="w", lw=0.3)
                ax.axvline(k * hw[1] - 0.5, color="w", lw=0.3)
            ax.set_title(f"layer {layer} head {h}: {title}", fontsize=8)
            ax.set_xticks([]), ax.set_yticks([])
    save_figure(fig, out, "fig2_attention_maps")


def plot_neighbour_queries(maps: list[Tensor], layer: int, hw: tuple[int, int], prefix: int, out: Path) -> None:
    import matplotlib.pyplot as plt

    H, W = hw
    a = maps[layer][0, 0, prefix:, prefix:].double()
    cy, cx = H // 2, W // 2
    queries = [(cy, cx), (cy, cx + 1), (cy + 1, cx), (cy + 1, cx + 1)]
    fig, axes = plt.subplots(1, len(queries), figsize=(3 * len(queries), 3.2))
    for ax, (y, x) in zip(axes, queries, strict=True):
        ax.imshow(a[y * W + x].reshape(H, W).numpy(), cmap="magma")
        ax.plot(x, y, "c+", ms=10)
        ax.set_title(f"query ({y}, {x})", fontsize=9)
        ax.set_xticks([]), ax.set_yticks([])
    fig.suptitle(f"layer {layer}, head 0: attention of neighbouring queries", fontsize=10)
    save_figure(fig, out, "fig3_neighbour_queries")


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = model_tool_parser(
        __doc__,
        "folder for bccb.json and the figures",
        "deit_tiny_patch16_224",
        "timm ViT-style model with softmax attention",
    )
    parser.add_argument("--images", default=None, help="folder of images (default: scikit-image's samples)")
    parser.add_argument("--num-images", type=positive_int, default=4)
    parser.add_argument("--figure-layer", type=int, default=None, help="layer shown in the figures (default: middle)")
    args = parser.parse_args(argv)

    model = model_from_args(args)
    x = to_model_input(load_images(args.images, args.num_images), model, args.img_size)
    grid = tuple(model.patch_embed.dynamic_feat_size(x.shape[-2:]))
    prefix = getattr(model, "num_prefix_tokens", 0)
    maps = capture_attention(model, x)
    layers = analyse(maps, grid, prefix, args.seed)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    figure_layer = len(maps) // 2 if args.figure_layer is None else args.figure_layer
    plot_maps(maps, figure_layer, grid, prefix, out)
    plot_neighbour_queries(maps, figure_layer, grid, prefix, out)
    summary = {
        "model": args.model,
        "checkpoint": args.checkpoint,
        "images": len(x),
        "grid": list(grid),
        "prefix_tokens": prefix,
        "layers": layers,
    }
    (out / "bccb.json").write_text(json.dumps(summary, indent=2))

    print(
        f"{args.model} ({'random weights' if args.checkpoint is None else args.checkpoint}), {len(x)} images, "
        f"grid {grid[0]}x{grid[1]}: relative distance to the BCCB subspace"
    )
    print(f"{'':>5} {'plain':^32} {'centred':^32}")
    print(f"{'layer':>5} " + f"{'attention':>10} {'permuted':>10} {'random':>10} " * 2)
    for r in layers:
        print(
            f"{r['layer']:>5} "
            + " ".join(
                f"{r[f'mean_{k}{c}']:>10.3f}"
                for c in ("", "_centred")
                for k in ("distance", "permuted", "random_stochastic")
            )
        )
    print(f"wrote {out / 'bccb.json'} and figures in {out}{os.sep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
