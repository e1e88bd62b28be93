"""Let torch's weights-only loader read mmengine checkpoints.

mmengine 0.10.7 calls ``torch.load`` without ``weights_only``, which is True by default since
torch 2.6, and its checkpoints hold the message hub's ``HistoryBuffer`` (numpy arrays inside), so
``resume`` and ``load_from`` fail. Rather than turning the safety off for everything
(``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``), exactly what those checkpoints contain is allow-listed.
"""
from __future__ import annotations

import builtins

import numpy as np
import torch

__all__ = ["allow_mmengine_checkpoints"]


def allow_mmengine_checkpoints() -> None:
    from mmengine.logging.history_buffer import HistoryBuffer

    numpy_reconstruct = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct
    numpy_scalar = np._core.multiarray.scalar if hasattr(np, "_core") else np.core.multiarray.scalar
    torch.serialization.add_safe_globals([
        HistoryBuffer, numpy_reconstruct, numpy_scalar, np.ndarray, np.dtype,
        *{type(np.dtype(t)) for t in ("float64", "float32", "int64", "int32", "bool")},
        builtins.getattr,
    ])
