"""Model creation and checkpoint-aware loading: ``cat.create_model`` and the weight adapters."""

from __future__ import annotations

import logging
import os
from typing import Any

import timm
import yaml
from timm.models.swin_transformer import SwinTransformer
from timm.models.swin_transformer import checkpoint_filter_fn as swin_filter
from timm.models.vision_transformer import VisionTransformer
from timm.models.vision_transformer import checkpoint_filter_fn as vit_filter
from torch import Tensor, nn

from cat.errors import ConfigError

from . import pvt
from .loading import (
    CheckpointMismatchError,
    LoadReport,
    check_name_hash,
    extract_state_dict,
    load_checkpoint_file,
    load_state_dict,
)

__all__ = [
    "create_model",
    "parse_model_args",
    "load_checkpoint",
    "load_weights",
    "load_backbone_checkpoint",
    "load_pretrained_file",
    "adapt_state_dict",
]

_logger = logging.getLogger(__name__)


# Per-family fixes for weights trained at another resolution: position embeddings resampled (PVT,
# ViT), relative-position tables resized to the window size (Swin; kept as they are when equal).
_STATE_DICT_ADAPTERS = (
    (pvt.PyramidVisionTransformer, pvt.checkpoint_filter_fn),
    (SwinTransformer, swin_filter),
    (VisionTransformer, vit_filter),
)


def adapt_state_dict(model: nn.Module, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state_dict`` with resolution-dependent tensors resized to fit ``model``."""
    for cls, adapter in _STATE_DICT_ADAPTERS:
        if isinstance(model, cls):
            return adapter(state_dict, model)
    return state_dict


def load_checkpoint(model: nn.Module, path: str | os.PathLike[str], strict: bool = True) -> LoadReport:
    """Load the weights in ``path`` (release format, bare state dict, or cat's own) into ``model``."""
    return load_weights(model, extract_state_dict(load_checkpoint_file(path), str(path)), strict, str(path))


def load_weights(model: nn.Module, state_dict: dict[str, Tensor], strict: bool = True, source: str = "") -> LoadReport:
    """Load a checkpoint's ``state_dict`` (read from ``source``) into ``model``, adapted to its resolution."""
    report = load_state_dict(model, adapt_state_dict(model, state_dict), strict=strict, source=source)
    if not report.clean:
        _logger.warning("partially loaded %s:\n%s", source, report)
    return report


def _without_classifier(model: nn.Module, state_dict: dict[str, Tensor]) -> tuple[dict[str, Tensor], str]:
    """``state_dict`` less its classifier entries, and the classifier's name."""
    classifier = getattr(model, "pretrained_cfg", {}).get("classifier", "head")
    return {k: v for k, v in state_dict.items() if not k.startswith(f"{classifier}.")}, classifier


def load_backbone_checkpoint(model: nn.Module, path: str | os.PathLike[str]) -> LoadReport:
    """Load an ImageNet classification checkpoint into a model used as a backbone.

    The classifier is dropped, position embeddings are resized to the model's grids and Swin's
    relative-position tables kept; the returned report lists everything that did not load.
    """
    state_dict, classifier = _without_classifier(model, extract_state_dict(load_checkpoint_file(path), str(path)))
    report = load_state_dict(model, adapt_state_dict(model, state_dict), strict=False, source=str(path))
    report.missing = [k for k in report.missing if not k.startswith(f"{classifier}.")]
    if not report.clean:
        _logger.warning("backbone weights from %s:\n%s", path, report)
    return report


def load_pretrained_file(model: nn.Module, path: str | os.PathLike[str]) -> LoadReport:
    """timm's ``load_pretrained`` hook (``custom_load`` configs): a release file, downloaded by timm
    into its cache or given as ``pretrained_cfg_overlay=dict(file=...)``, read by the safe loader after
    its name's hash is checked. Everything must match except a classifier of another class count
    (``num_classes=``), which keeps its fresh initialisation."""
    check_name_hash(path)
    state_dict = adapt_state_dict(model, extract_state_dict(load_checkpoint_file(path), str(path)))
    own = model.state_dict()
    without_classifier, classifier = _without_classifier(model, state_dict)
    other_classifier = any(
        k not in own or own[k].shape != v.shape for k, v in state_dict.items() if k not in without_classifier
    )
    if other_classifier:
        _logger.info("pretrained %s: classifier %r not loaded (another class count)", path, classifier)
        state_dict = without_classifier
    report = load_state_dict(model, state_dict, strict=False, source=str(path))
    if other_classifier:
        report.missing = [k for k in report.missing if not k.startswith(f"{classifier}.")]
    if not report.clean:
        raise CheckpointMismatchError(report, str(path))
    return report


def create_model(
    name: str, checkpoint: str | os.PathLike[str] | None = None, strict: bool = True, **kwargs: Any
) -> nn.Module:
    """``timm.create_model(name, **kwargs)``, then load ``checkpoint`` if given.

    Raises a ``ValueError`` naming close matches for an unknown model, and
    :class:`CheckpointMismatchError` listing mismatched keys unless ``strict=False``.
    """
    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('_')[0]}*")[:10]
        raise ConfigError(f"unknown model {name!r}" + (f"; similar: {', '.join(close)}" if close else ""))
    model = timm.create_model(name, **kwargs)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint, strict=strict)
    return model


def parse_model_args(pairs: list[str]) -> dict[str, Any]:
    """``["patch_size=4", "embed_dim=64"]`` -> ``{"patch_size": 4, "embed_dim": 64}`` (YAML values)."""
    args = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"model argument {pair!r} must look like KEY=VALUE")
        args[key] = yaml.safe_load(value)
    return args
