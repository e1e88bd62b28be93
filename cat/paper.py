"""The paper's reported numbers (``cat/paper_tables.yaml``), for tools and tests."""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import yaml

__all__ = ["paper_table", "available_tables", "paper_top1"]


@cache
def _tables() -> dict[str, Any]:
    return yaml.safe_load(resources.files("cat").joinpath("paper_tables.yaml").read_text())


def paper_table(number: int) -> dict[str, Any]:
    """Table ``number`` of the paper: ``title``, default ``tolerance`` and ``rows``."""
    key = f"table{number}"
    tables = _tables()
    if key not in tables:
        raise ValueError(f"no table {number} in cat/paper_tables.yaml (have: {', '.join(sorted(tables))})")
    return tables[key]


def available_tables() -> list[int]:
    """Numbers of the tables held in ``cat/paper_tables.yaml``."""
    return sorted(int(k[len("table") :]) for k in _tables() if k.startswith("table"))


def paper_top1(model: str, img_size: int) -> tuple[str, float] | None:
    """The paper's ImageNet-1K top-1 for ``model`` at ``img_size`` (Table 2's label and number), None where the table
    prints none for it (another model or size, or a reconstruction's target)."""
    for row in paper_table(2)["rows"]:
        if row["model"] == model and row["img_size"] == img_size and "top1" in row.get("paper", {}):
            return row["label"], float(row["paper"]["top1"])
    return None
