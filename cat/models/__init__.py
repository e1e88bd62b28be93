"""Model families (registered in timm on import) and checkpoint-aware model creation."""
from __future__ import annotations

import logging
import os
from typing import Any

import timm
from torch import nn

from . import deit  # noqa: F401  (registers the CA-DeiT family with timm)
from .checkpoint import (
    CheckpointMismatchError,
    LoadReport,
    UnsafeCheckpointError,
    extract_state_dict,
    load_checkpoint_file,
    load_state_dict,
)
from .deit import CirculantVisionTransformer

__all__ = ["create_model", "load_checkpoint", "CirculantVisionTransformer", "CheckpointMismatchError",
           "LoadReport", "UnsafeCheckpointError", "load_checkpoint_file", "extract_state_dict", "load_state_dict"]

_logger = logging.getLogger(__name__)


def load_checkpoint(model: nn.Module, path: str | os.PathLike[str], strict: bool = True) -> LoadReport:
    """Load the weights in ``path`` (release format, bare state dict, or cat's own) into ``model``."""
    report = load_state_dict(model, extract_state_dict(load_checkpoint_file(path)), strict=strict, source=str(path))
    if not report.clean:
        _logger.warning("partially loaded %s:\n%s", path, report)
    return report


def create_model(name: str, checkpoint: str | os.PathLike[str] | None = None, strict: bool = True,
                 **kwargs: Any) -> nn.Module:
    """``timm.create_model(name, **kwargs)``, then load ``checkpoint`` if given.

    Raises a ``ValueError`` naming close matches for an unknown model, and
    :class:`CheckpointMismatchError` listing mismatched keys unless ``strict=False``.
    """
    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('_')[0]}*")[:10]
        raise ValueError(f"unknown model {name!r}" + (f"; similar: {', '.join(close)}" if close else ""))
    model = timm.create_model(name, **kwargs)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint, strict=strict)
    return model
