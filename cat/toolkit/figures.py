"""Figures the tools write: PNG for reading, PDF for papers, one call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["save_figure"]


def save_figure(fig: Any, out: Path, stem: str, dpi: int = 150) -> None:
    """Write ``out/stem.png`` and ``out/stem.pdf`` from a Matplotlib figure, then close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    for suffix in ("png", "pdf"):
        fig.savefig(out / f"{stem}.{suffix}", dpi=dpi)
    plt.close(fig)
