"""The paper's reported numbers (``cat/paper_tables.yaml``), for tools and tests."""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import yaml

__all__ = ["paper_table", "available_tables"]


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
