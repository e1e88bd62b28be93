"""Model creation and checkpoint-aware loading: ``cat.create_model`` and the weight adapters."""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

import timm
import torch
import yaml
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from cat.errors import CheckpointError, ConfigError

from .loading import (
    CheckpointMismatchError,
    LoadReport,
    adapt_state_dict,
    extract_state_dict,
    load_checkpoint_file,
    load_for_fine_tuning,
    load_state_dict,
    without_classifier,
)

__all__ = [
    "cat_model_names",
    "create_model",
    "on_meta",
    "model_arguments",
    "model_kwargs",
    "parse_model_args",
    "load_checkpoint",
    "load_weights",
    "load_backbone_checkpoint",
    "backbone_state_dict",
]

_logger = logging.getLogger(__name__)


def load_checkpoint(
    model: nn.Module, path: str | os.PathLike[str], strict: bool = True, use_ema: bool = False
) -> LoadReport:
    """Load the weights in ``path`` (release format, bare state dict, or cat's own) into ``model``; with
    ``use_ema`` the weight EMA the file holds (timm's name for the choice; timm's own loader prefers it by default)."""
    state_dict = extract_state_dict(load_checkpoint_file(path), str(path), use_ema)
    return load_weights(model, state_dict, strict, str(path))


def load_weights(
    model: nn.Module, state_dict: dict[str, Tensor], strict: bool = True, source: str = "", new_classifier: bool = False
) -> LoadReport:
    """Load a checkpoint's ``state_dict`` (read from ``source``) into ``model``, adapted to its resolution;
    with ``new_classifier`` a classifier for another class count keeps its fresh initialisation
    (:func:`~cat.models.loading.load_for_fine_tuning`)."""
    if new_classifier:
        report = load_for_fine_tuning(model, state_dict, strict, source)
    else:
        report = load_state_dict(model, adapt_state_dict(model, state_dict), strict=strict, source=source)
    if not report.clean:
        _logger.warning("partially loaded %s:\n%s", source, report)
    return report


# What a detector's or segmentor's checkpoint keeps its backbone's weights under (mmdet's and mmseg's models).
DENSE_BACKBONE_PREFIX = "backbone."


def backbone_state_dict(model: nn.Module, path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The weights of the classification checkpoint ``path`` for ``model`` used as a backbone, read by the safe
    loader; a CheckpointError where the file is a detector's or segmentor's (its backbone's weights under
    ``backbone.``, beside its neck's and heads'), naming the ``prefix`` that reads its backbone from it."""
    state_dict = extract_state_dict(load_checkpoint_file(path), str(path))
    under = [k for k in state_dict if k.startswith(DENSE_BACKBONE_PREFIX)]
    if under and not any(k.startswith(DENSE_BACKBONE_PREFIX) for k in model.state_dict()):
        beside = sorted({k.split(".", 1)[0] for k in state_dict} - {DENSE_BACKBONE_PREFIX[:-1]})
        raise CheckpointError(
            f"{path} holds a detector's or segmentor's weights ({len(under)} of its {len(state_dict)} tensors under "
            f"'{DENSE_BACKBONE_PREFIX}'" + (f", beside {', '.join(beside[:4])}" if beside else "") + "), not a "
            "classification model's: to start the backbone from its backbone, pass init_cfg=dict(type='Pretrained', "
            f"checkpoint='{path}', prefix='{DENSE_BACKBONE_PREFIX}') instead of pretrained (or checkpoint=... to "
            "start the whole model from it)"
        )
    return state_dict


def load_backbone_checkpoint(
    model: nn.Module, path: str | os.PathLike[str], strict: bool = False, pruned: Iterable[str] = ()
) -> LoadReport:
    """Load an ImageNet classification checkpoint into a model used as a backbone.

    The classifier is dropped, position embeddings are resized to the model's grids and Swin's
    relative-position tables kept; the returned report lists everything else that did not load,
    except the ``pruned`` entries (those of the classification model the backbone left out: its
    final norm, stages after the last it returns). With ``strict`` anything in that report raises
    :class:`CheckpointMismatchError`: weights of another model, or of the family at another size.
    A detector's or segmentor's checkpoint is refused (:func:`backbone_state_dict`).
    """
    state_dict, classifier = without_classifier(model, backbone_state_dict(model, path))
    # Left out before the adapters, which look up the module of what they resize (Swin's: a pruned last stage).
    pruned = set(pruned)
    state_dict = {k: v for k, v in state_dict.items() if k not in pruned}
    report = load_state_dict(model, adapt_state_dict(model, state_dict), strict=False, source=str(path))
    report.missing = [k for k in report.missing if not k.startswith(f"{classifier}.")]
    if strict and not report.clean:
        name = getattr(model, "pretrained_cfg", {}).get("architecture", type(model).__name__)
        raise CheckpointMismatchError(
            report,
            str(path),
            f"a {name} backbone takes every one of its weights from it; strict_load=false starts what does not fit "
            "from the initialisation",
        )
    if not report.clean:
        _logger.warning("backbone weights from %s:\n%s", path, report)
    return report


def cat_model_names() -> list[str]:
    """The timm names of the models cat registers (its model families' factories), sorted."""
    return [name for name in timm.list_models() if timm.models.model_entrypoint(name).__module__.startswith("cat.")]


def check_model_name(name: str) -> None:
    """A ConfigError naming close matches where ``name`` is not a registered model (cat's or timm's)."""
    if not timm.is_model(name):
        names = timm.list_models()
        # A name cut short (a config group's, deit_tiny) first, then names spelled alike.
        close = [n for n in names if n.startswith(name)][:6] or difflib.get_close_matches(name, names, 6, 0.75)
        raise ConfigError(f"unknown model {name!r}" + (f"; similar: {', '.join(close)}" if close else ""))


def create_model(
    name: str,
    checkpoint: str | os.PathLike[str] | None = None,
    strict: bool = True,
    use_ema: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """``timm.create_model(name, **kwargs)``, then load ``checkpoint`` if given (its weight EMA with ``use_ema``).

    Raises a ``ValueError`` naming close matches for an unknown model, and
    :class:`CheckpointMismatchError` listing mismatched keys unless ``strict=False``.
    """
    check_model_name(name)
    model = timm.create_model(name, **kwargs)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint, strict=strict, use_ema=use_ema)
    return model


def model_kwargs(drop_path_rate: float | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A config's model arguments: ``kwargs``, and ``drop_path_rate`` unless it is None (which
    means the model factory's value, in classification and in det/seg backbones alike)."""
    return {**kwargs, **({} if drop_path_rate is None else {"drop_path_rate": drop_path_rate})}


# The in-place ops weight initialisation fills values with (timm's trunc_normal_: uniform_, erfinv_, mul_, add_,
# clamp_; torch.nn.init's zeros_, ones_, constant_, normal_): none changes a shape, dtype or flag.
_VALUE_FILLS = frozenset(
    {"uniform_", "normal_", "erfinv_", "clamp_", "mul_", "add_", "sub_", "div_", "zero_", "fill_", "copy_"}
)


class _SkipValueFillsOnMeta(TorchFunctionMode):
    """Value fills of meta tensors as no-ops: a meta tensor holds no values, and its fills run through Python meta
    kernels, most of the time a model takes to build on the meta device."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__name__", None) in _VALUE_FILLS and args and isinstance(args[0], Tensor) and args[0].is_meta:
            return args[0]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build modules here on the meta device: their parameters' shapes, dtypes and flags, no memory, and no
    initialisation of the values they do not hold. Run their forward under ``torch.device("meta")``."""
    with torch.device("meta"), _SkipValueFillsOnMeta():
        yield


@functools.cache
def model_arguments(name: str) -> frozenset[str] | None:
    """The keyword arguments ``create_model(name, ...)`` accepts: its factory's own and its model
    class's (through its bases while they forward ``**kwargs``); None when one takes anything.
    The class is found by building the model on the meta device (no memory, no compute)."""
    check_model_name(name)
    with on_meta():
        model = timm.create_model(name)
    accepted = {"pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "checkpoint_path", "cache_dir"}
    for cls in type(model).__mro__:
        if cls is nn.Module or "__init__" not in vars(cls):
            continue
        parameters = inspect.signature(vars(cls)["__init__"]).parameters
        accepted |= {n for n, p in parameters.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL} - {"self"}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return frozenset(accepted - {"kwargs"})
    return None


def parse_model_args(pairs: list[str]) -> dict[str, Any]:
    """``["patch_size=4", "embed_dim=64"]`` -> ``{"patch_size": 4, "embed_dim": 64}`` (YAML values)."""
    args = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"model argument {pair!r} must look like KEY=VALUE")
        try:
            args[key] = yaml.safe_load(value)
        except yaml.YAMLError as error:  # a tag (!!python/...) or malformed YAML: not a plain value
            reason = str(error).strip().splitlines()[0]
            raise ConfigError(f"model argument {pair!r}: {value!r} is not a plain YAML value ({reason})") from None
    return args
