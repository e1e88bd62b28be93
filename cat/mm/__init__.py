"""The OpenMMLab bridge shared by detection and segmentation: cat backbones in the mmdet/mmseg
registries (``cat.mm.backbone``), the Hydra -> mmengine config, safe checkpoint loading and
CPU-distributed fixes. Importing this package needs none of the stack: :func:`run_mm` checks for it
first and says how to set it up."""

from __future__ import annotations

import importlib.util
from typing import Any

from omegaconf import DictConfig

from cat.errors import UserError

from . import schema  # noqa: F401  (registers schema/det and schema/seg: needs none of the stack)

__all__ = ["MM_SETUP", "MissingStackError", "require_stack", "run_mm"]

MM_SETUP = "bash scripts/setup_env.sh --mm"
_STACK = {"det": ("detection", ("mmengine", "mmcv", "mmdet")), "seg": ("segmentation", ("mmengine", "mmcv", "mmseg"))}


class MissingStackError(UserError, ImportError):
    """The OpenMMLab packages a detection or segmentation job needs are not installed."""


def require_stack(task: str) -> None:
    """Raise :class:`MissingStackError`, naming the missing packages and the setup command, unless
    the stack for ``task`` ('det' or 'seg') is installed."""
    what, packages = _STACK[task]
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingStackError(
            f"{what} needs the OpenMMLab stack ({', '.join(missing)} not installed); set it up with: {MM_SETUP}"
        )


def run_mm(cfg: DictConfig, task: str) -> dict[str, Any]:
    """Train or evaluate a detection (``task='det'``) or segmentation (``'seg'``) job; see
    :func:`cat.mm.runner.run_mm`."""
    require_stack(task)
    from .runner import run_mm as run

    return run(cfg, task)
