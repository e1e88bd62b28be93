"""The tables the documentation restates from the code, rendered from it: the pages hold them verbatim and
tests/test_docs.py checks that they still do (regenerate a page's table from here when the code changes)."""

from __future__ import annotations

from cat.models.deit import RELEASE_URLS
from cat.paper import paper_table

# The experiment preset (configs/cls/experiment/) that trains each Table 2 model.
_CLS_EXPERIMENTS = {
    "ca_deit_tiny": "ca_deit_t",
    "ca_deit_small": "ca_deit_s",
    "ca_deit_base": "ca_deit_b",
    "ca_pvt_tiny": "ca_pvt_t",
    "ca_pvt_small": "ca_pvt_s",
    "ca_pvt_medium": "ca_pvt_m",
    "ca_pvt_large": "ca_pvt_l",
    "ca_swin_tiny": "ca_swin_t",
    "ca_swin_small": "ca_swin_s",
    "ca_swin_base": "ca_swin_b",
    "ca_swin_base_384": "ca_swin_b_384",
    "cat_tiny": "cat_t",
    "cat_small": "cat_s",
    "cat_base": "cat_b",
}


def _number(value: float) -> str:
    return f"{value:g}"


def _decimal(value: float) -> str:
    return f"{value:.1f}"


def zoo_table() -> str:
    """The README's model zoo: every circulant model of Table 2, its numbers and where its weights come from."""
    lines = [
        "| model | `timm` name | res | params | GFLOPs | top-1 (paper) | weights | experiment |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in paper_table(2)["rows"]:
        if row["model"] not in _CLS_EXPERIMENTS:
            continue
        label = row["label"].replace(" (384)", "")
        top1 = _decimal(row["paper"]["top1"]) if "top1" in row.get("paper", {}) else "— (reconstruction)"
        if row["model"] in RELEASE_URLS:
            weights = f"[release]({RELEASE_URLS[row['model']]})"
        elif row["img_size"] != 224:
            weights = "fine-tune CA-Swin-B"
        else:
            weights = "train it"
        lines.append(
            f"| {label} | `{row['model']}` | {row['img_size']} | {_number(row['params_m'])} M | "
            f"{_decimal(row['gflops'])} | {top1} | {weights} | `{_CLS_EXPERIMENTS[row['model']]}` |"
        )
    return "\n".join(lines)


def paper_rows_table(number: int) -> str:
    """Table ``number`` (3, 4 or 5) as the reproducing page gives it: each row's preset or model options and the
    paper's numbers."""
    table = paper_table(number)
    metrics = list(table["metrics"])
    head = ["row", "preset" if number in (3, 4) else "model (options)", *[table["metrics"][m] for m in metrics]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table["rows"]:
        if number in (3, 4):
            how = f"`{row['experiment']}`"
        else:
            options = ", ".join(f"{k}={v}" for k, v in row.get("model_args", {}).items())
            how = f"`{row['model']}`" + (f" ({options})" if options else "")
        paper = row.get("paper", {})
        values = [_decimal(paper[m]) if m in paper else "—" for m in metrics]
        lines.append("| " + " | ".join([row["label"], how, *values]) + " |")
    return "\n".join(lines)


# The one measured training step the estimates scale from: CA-DeiT-T at 224^2, batch 64, bf16 autocast, eager, on one
# H200 (docs/perf/gpu-check-h200-2026-12-04.md, the autograd path, lean_attention=false), in milliseconds.
MEASURED_STEP_MS, MEASURED_BATCH, MEASURED_GFLOPS = 66.1, 64, 1.2
IMAGENET_TRAIN_IMAGES = 1_281_167


def recipe_cost_table(epochs: dict[str, int]) -> str:
    """What each Table 2 recipe costs on H200s, estimated: the measured CA-DeiT-T step's time per image scaled by
    each model's GFLOPs, times the recipe's ``epochs`` (model -> epochs, from its preset) over ImageNet-1K's
    training images; 8 GPUs in parallel, assumed to scale linearly."""
    per_gflop_s = MEASURED_STEP_MS / 1e3 / MEASURED_BATCH / MEASURED_GFLOPS
    lines = [
        "| model | experiment | epochs | GFLOPs | H200 GPU-hours (est.) | wall time on 8 H200 (est.) |",
        "|---|---|---|---|---|---|",
    ]
    for row in paper_table(2)["rows"]:
        if row["model"] not in _CLS_EXPERIMENTS:
            continue
        hours = epochs[row["model"]] * IMAGENET_TRAIN_IMAGES * per_gflop_s * row["gflops"] / 3600
        lines.append(
            f"| {row['label']} | `{_CLS_EXPERIMENTS[row['model']]}` | {epochs[row['model']]} | "
            f"{_decimal(row['gflops'])} | {hours:,.0f} | {hours / 8:,.0f} h |"
        )
    return "\n".join(lines)


def recipe_epochs() -> dict[str, int]:
    """Each Table 2 model's training epochs, from its preset as train_cls.py composes it."""
    import cat.runtime.config_help  # noqa: F401  (the resolvers the trainers' configs name)
    from tests.conftest import compose_config

    return {
        model: int(compose_config("cls", f"experiment={experiment}").epochs)
        for model, experiment in _CLS_EXPERIMENTS.items()
    }
