"""The checks of a detection or segmentation config before anything is built: the schema's, then the
paths, the backbone's arguments and its feature levels against the heads. :func:`check_mm_config` returns
the config as its typed object."""

from __future__ import annotations

import os

from cat.errors import ConfigError
from cat.models import model_arguments
from cat.runtime.folder import run_dir_for
from cat.runtime.ownership import output_dir_problems
from cat.runtime.resume import resumes, starting_file_problem

from .bases import base_config_path
from .safe_load import LAST_CHECKPOINT
from .schema import MMConfig
from .task import TaskConfig

__all__ = ["check_mm_config"]


def _backbone_kwargs_problems(cfg: MMConfig) -> list[str]:
    backbone = cfg.model.backbone
    try:
        accepted = model_arguments(backbone.name)
    except ConfigError as error:
        return [f"model.backbone.name: {problem}" for problem in error.problems]
    if accepted is None:
        return []
    return [
        f"model.backbone.kwargs.{name}: not an argument of {backbone.name} (accepted: {', '.join(sorted(accepted))})"
        for name in backbone.kwargs
        if name not in accepted
    ]


def check_mm_config(cfg: TaskConfig) -> TaskConfig:
    """Every problem with a detection/segmentation config (a :class:`DetConfig` or :class:`SegConfig`, typed and
    settled by :func:`~cat.runtime.cells.typed_job_config`) before anything is built (ConfigError); the config
    when there is none."""
    problems: list[str] = []
    if cfg.data.classes is not None and not cfg.data.classes:
        problems.append("data.classes=[]: name one class or more, or null for all of the dataset's")
    if cfg.mode == "eval" and not cfg.checkpoint:
        problems.append("mode=eval needs checkpoint=PATH (a detector/segmentor checkpoint)")
    # A resumed training run reads neither: its folder's checkpoint holds the model (cat.mm.config).
    starting = {"checkpoint": cfg.checkpoint, "model.pretrained": cfg.model.pretrained}
    for name, path in () if resumes(cfg, LAST_CHECKPOINT) else starting.items():
        # Either may be a URL or model-zoo name: fetched as mmengine fetches one, read by cat's safe loader.
        remote = isinstance(path, str) and "://" in path
        if isinstance(path, str) and not remote:
            problems += [problem] if (problem := starting_file_problem(cfg, name, path)) else []
    if not (isinstance(cfg.data.root, str) and os.path.isdir(cfg.data.root)):
        problems.append(
            f"data.root={cfg.data.root}: not a folder with the dataset "
            "(tools/make_toy_coco.py / tools/make_toy_ade.py write toy ones)"
        )
    problems += output_dir_problems(cfg.output_dir, [cfg.data.root], run_dir_for(cfg.output_dir, cfg.mode))
    problems += _backbone_kwargs_problems(cfg)
    try:
        base_config_path(cfg.model.base)
    except ConfigError as error:
        problems += error.problems
    if problems:
        raise ConfigError(problems)
    from .config import backbone_problems  # needs the OpenMMLab stack: only once the keys are valid

    problems += backbone_problems(cfg.model)
    if problems:
        raise ConfigError(problems)
    return cfg
