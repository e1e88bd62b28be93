"""The paper's Fig. 4 as the speed tools draw it (tools/benchmark.py, tools/gpu_check.py): the models it compares,
their FLOPs, and the figure from a measured result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cat.flops import model_cost

from .figures import save_figure
from .variants import split_variant

__all__ = ["MODELS", "gflops", "plot"]

# Fig. 4's models, by label: circulant attention against softmax attention as SDPA and as the paper's two matmuls.
MODELS = {
    "CA-DeiT-T": "ca_deit_tiny",
    "DeiT-T (SDPA)": "deit_tiny_patch16_224",
    "DeiT-T (matmul)": "deit_tiny_patch16_224+matmul",
}


def gflops(spec: str, res: int) -> float:
    """The forward GFLOPs of ``MODEL[+VARIANT]`` at ``res``² as the paper counts them."""
    return model_cost(split_variant(spec)[0], (res, res))[1] / 1e9


def plot(result: dict[str, Any], out: Path) -> None:
    """Fig. 4 of a speed tool's ``result`` into ``out`` (fig4_efficiency.png and .pdf)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = bool(result["families"])
    fig, axes = plt.subplots(1, 4 if families else 2, figsize=(18 if families else 9, 3.8))
    ax_flops, ax_fps = axes[:2]
    res = result["resolutions"]
    labels = list(result["gflops"])  # the models the result measured (MODELS, and any a tool adds)
    for label in labels:
        if label != "DeiT-T (matmul)":  # the same FLOPs as SDPA's
            ax_flops.plot(res, [result["gflops"][label][str(r)] for r in res], "o-", label=label)
    for dtype, rows in result["speed"].items():
        style = "o-" if dtype == "fp32" else "s--"
        for label in labels:
            ax_fps.plot(res, [rows[str(r)][label]["infer_img_s"] for r in res], style, label=f"{label} {dtype}")
    last = str(res[-1])
    for dtype, rows in result["speed"].items():  # CA-DeiT-T's speed-up over the paper's baseline, at the largest
        ratio = rows[last]["CA-DeiT-T"]["infer_img_s"] / rows[last]["DeiT-T (matmul)"]["infer_img_s"]
        ax_fps.annotate(f"{ratio:.1f}x ({dtype})", (res[-1], rows[last]["CA-DeiT-T"]["infer_img_s"]), fontsize=8)
    ax_flops.set(xlabel="resolution", ylabel="GFLOPs", yscale="log", title="(a) FLOPs")
    ax_fps.set(xlabel="resolution", ylabel="images / s", yscale="log", title=f"(b) inference, {result['device']}")
    trade_offs = zip(axes[2:], ("infer_img_s", "train_img_s"), ("(c) inference", "(d) training"), strict=False)
    for ax, key, title in trade_offs:
        for family, marker in (("DeiT", "o"), ("CA-DeiT", "s")):
            rows = [r for r in result["families"] if r["label"].rsplit("-", 1)[0] == family]
            ax.plot([r[key] for r in rows], [r["top1"] for r in rows], f"{marker}-", label=family)
            for r in rows:
                ax.annotate(r["label"].rsplit("-", 1)[1], (r[key], r["top1"]), fontsize=8)
        ax.set(
            xlabel=f"images / s at {result['families_res']}² ({result['families_dtype']})",
            ylabel="ImageNet top-1 (paper)",
            title=title,
        )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, out, "fig4_efficiency", dpi=120)
