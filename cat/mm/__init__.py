"""The OpenMMLab bridge shared by detection and segmentation: cat backbones in the mmdet/mmseg
registries (``cat.mm.backbone``), the Hydra -> mmengine config, safe checkpoint loading and
CPU-distributed fixes.

Importing this package registers all of cat's OpenMMLab components where the stack is installed
(:mod:`cat.mm.plugin`: the line ``custom_imports = dict(imports=['cat.mm'])`` in a config for mmdet's or
mmseg's own tools), and needs none of it otherwise: :func:`run_mm` checks for it first and says how to set
it up."""

from __future__ import annotations

import importlib.util
from typing import Any

from omegaconf import DictConfig

from cat.errors import UserError

from .det import DET  # registers schema/det and schema/seg (cat.mm.schema): needs none of the stack
from .seg import SEG
from .task import MMTask

__all__ = ["DET", "SEG", "MMTask", "MM_SETUP", "MissingStackError", "require_stack", "run_mm"]

MM_SETUP = "bash scripts/setup_env.sh --mm"


class MissingStackError(UserError, ImportError):
    """The OpenMMLab packages a detection or segmentation job needs are not installed."""


def require_stack(task: MMTask[Any]) -> None:
    """Raise :class:`MissingStackError`, naming the missing packages and the setup command, unless
    the stack for ``task`` (:data:`DET` or :data:`SEG`) is installed."""
    missing = [name for name in task.stack if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingStackError(
            f"{task.what} needs the OpenMMLab stack ({', '.join(missing)} not installed); set it up with: {MM_SETUP}"
        )


def run_mm(cfg: DictConfig, task: MMTask[Any]) -> dict[str, Any]:
    """Train or evaluate a detection (:data:`DET`) or segmentation (:data:`SEG`) job; see
    :func:`cat.mm.runner.run_mm`."""
    require_stack(task)
    from .runner import run_mm as run

    return run(cfg, task)


# Last: the stack-free names above exist whatever the stack's import does.
if importlib.util.find_spec("mmengine") is not None:
    from .plugin import register

    register()
