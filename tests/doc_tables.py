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
