"""Figures the tools write: PNG for reading, PDF for papers, one call."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from cat.runtime.io import atomic_write

__all__ = ["save_figure"]


def save_figure(fig: Any, out: Path, stem: str, dpi: int = 150) -> None:
    """Write ``out/stem.png`` and ``out/stem.pdf`` from a Matplotlib figure, then close it. Each is written beside its
    name and renamed over it: what is planted at the name (a link, a FIFO, a folder) is refused, never written
    through (:func:`cat.runtime.io.atomic_write`)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        for suffix in ("png", "pdf"):
            atomic_write(str(out / f"{stem}.{suffix}"), functools.partial(fig.savefig, format=suffix, dpi=dpi))
    finally:
        plt.close(fig)
