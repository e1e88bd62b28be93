"""Shared by the Hydra entry points (train_cls.py, train_det.py, train_seg.py)."""
from __future__ import annotations

import os
import sys

__all__ = ["quiet_hydra_on_other_ranks"]


def quiet_hydra_on_other_ranks() -> None:
    """Only rank 0 lets Hydra write its run folder; under torchrun the other ranks would race on it."""
    if int(os.environ.get("RANK", "0")) > 0:
        sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=."]
