"""The detection (``train_det.py``) and segmentation (``train_seg.py``) configs: typed schemas on
top of :class:`~cat.runtime.schema.JobConfig`, and :func:`check_mm_config`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from cat.errors import ConfigError
from cat.models import model_arguments
from cat.runtime.resume import resumes, starting_file_problem
from cat.runtime.rundir import check_writable
from cat.runtime.schema import (
    FIXED,
    FREE,
    JobConfig,
    SaveConfig,
    key,
    register_schema,
    schema_problems,
    section,
    typed_config,
)

from .safe_load import LAST_CHECKPOINT

__all__ = ["DetConfig", "SegConfig", "check_mm_config"]


@dataclass
class BackboneConfig:
    name: str = key("a registered model with forward_intermediates (cat's or timm's)")
    drop_path_rate: float | None = key("stochastic depth; null: the model factory's value", min=0, max=1)
    out_indices: list[int] = key(
        "the feature levels (timm's feature_info) whose maps feed the neck, at the strides the heads are built "
        "for (4, 8, 16, 32; a timm ResNet's levels 1-4)",
        min=0,
    )
    out_norm: bool = key("normalise each output feature map")
    lean_attention: Any = key(
        "circulant attention's memory-lean backward: auto (blocks of B*N*C >= cat.ops.LEAN_AUTO_MIN_FLOATS), "
        "true (every block: least memory) or false (autograd: faster, more memory)",
        choices=("auto", True, False),
        resume=FREE,  # the same math, computed another way
    )
    grad_checkpointing: bool = key(
        "recompute each block's activations in the backward (timm's set_grad_checkpointing)", resume=FREE
    )
    kwargs: dict[str, Any] = key("extra model arguments, checked against the model's")


@dataclass
class MMModelConfig:
    base: str = key("the packaged OpenMMLab config it starts from, e.g. mmdet::mask_rcnn/...py")
    backbone: BackboneConfig = section(BackboneConfig, "cat's backbone in it")
    pretrained: str | None = key(
        "ImageNet checkpoint of the backbone (train_cls.py output or release format)", resume=FREE
    )
    overrides: dict[str, Any] = key("dotted keys into the model config, e.g. {neck.out_channels: 128}")


@dataclass
class MMOptimConfig:
    type: str = key("an optimizer type mmengine knows (AdamW, SGD, ...)")
    lr: float = key("learning rate at the paper's total batch", min=0, exclusive_min=True)
    weight_decay: float = key("weight decay (none on no_decay_keys)", min=0)
    betas: list[float] = key("Adam betas", min=0, max=1, exclusive_max=True)
    clip_grad: float | None = key("max gradient norm; null: no clipping", min=0, exclusive_min=True)
    no_decay_keys: list[str] = key("parameter-name parts without weight decay")


@dataclass
class MMSaveConfig(SaveConfig):
    keep_last: int = key("iteration/epoch checkpoints kept", min=1)
    interval: int = key("epochs (epoch-based schedules) or iterations between checkpoints", min=1)


@dataclass
class MMConfig(JobConfig):
    # A resume may not change the model, data, batch, accumulation, seed or schedule (FIXED): mmengine's resume
    # restores the optimizer's and the schedulers' state over the config's (rates, milestones, ends), so a changed
    # optimizer or schedule would silently not apply. The run may grow longer (the loop's length is the config's;
    # the restored schedules end where they did), the data may move.
    model: MMModelConfig = section(MMModelConfig, "the detector or segmentor", resume=FIXED)
    save: MMSaveConfig = section(MMSaveConfig, "checkpoints")
    batch_size: int = key("images per process and iteration", min=1, resume=FIXED)
    accum_steps: int = key(
        "iterations per optimizer step, gradients accumulated (mmengine's accumulative_counts; schedules count "
        "iterations)",
        min=1,
        resume=FIXED,
    )
    find_unused_parameters: bool = key("DDP's find_unused_parameters")
    mm: dict[str, Any] = key("extra mmengine config options, dotted keys: {train_cfg.val_interval: 2}")


@dataclass
class MMDataConfig:
    name: str = key("the dataset's name (coco, toy_coco; ade20k, toy_ade)")
    root: str | None = key(
        "the dataset folder (COCO: train2017/, val2017/, annotations/; ADE20K: images/, annotations/)",
        resume=FREE,
        in_run_name=False,
    )
    classes: list[str] | None = key("a subset of the dataset's classes; null: all (COCO's 80, ADE20K's 150)")


@dataclass
class DetDataConfig(MMDataConfig):
    img_scale: list[int] = key("test and 1x-train scale [long, short]", min=1)
    multiscale_train: list[int] | None = key("[480, 800]: random shorter side in that range (3x)", min=1)


@dataclass
class DetScheduleConfig:
    epochs: int = key("training epochs", min=1, resume=FREE)
    steps: list[int] = key("epochs after which lr drops 10x", min=1)
    val_interval: int = key("epochs between evaluations", min=1, resume=FREE)
    warmup_iters: int = key("linear warm-up iterations", min=0)
    warmup_ratio: float = key("warm-up start lr / lr", min=0, max=1, exclusive_min=True)
    total_batch: int = key("the paper's total batch (lr is for it)", min=1)
    optim: MMOptimConfig = section(MMOptimConfig, "the optimizer")


@dataclass
class DetConfig(MMConfig):
    data: DetDataConfig = section(DetDataConfig, "the COCO-format dataset", resume=FIXED)
    schedule: DetScheduleConfig = section(DetScheduleConfig, "the epoch schedule", resume=FIXED)


@dataclass
class SegDataConfig(MMDataConfig):
    crop_size: list[int] = key("training crop [height, width]", min=1)
    scale: list[int] = key("resize base [long, short] (train: ratio 0.5-2.0) and test scale", min=1)


@dataclass
class SegScheduleConfig:
    iters: int = key("training iterations", min=1, resume=FREE)
    val_interval: int = key("iterations between evaluations", min=1, resume=FREE)
    warmup_iters: int = key("linear warm-up iterations", min=0)
    poly_power: float = key("poly decay power", min=0, exclusive_min=True)
    optim: MMOptimConfig = section(MMOptimConfig, "the optimizer")


@dataclass
class SegConfig(MMConfig):
    data: SegDataConfig = section(SegDataConfig, "the ADE20K-format dataset", resume=FIXED)
    schedule: SegScheduleConfig = section(SegScheduleConfig, "the iteration schedule", resume=FIXED)
    tta: bool = key("eval: multi-scale + flip testing")


register_schema("det", DetConfig)
register_schema("seg", SegConfig)


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


def check_mm_config(raw: DictConfig, schema: type[MMConfig]) -> MMConfig:
    """Every problem with a detection/segmentation config (``schema``: :class:`DetConfig` or :class:`SegConfig`),
    before anything is built (ConfigError); the config as its typed object when there is none."""
    problems = schema_problems(raw, schema)
    if problems:
        raise ConfigError(problems)
    cfg = typed_config(raw, schema)
    if cfg.mode == "eval" and not cfg.checkpoint:
        problems.append("mode=eval needs checkpoint=PATH (a detector/segmentor checkpoint)")
    # A resumed training run reads neither: its folder's checkpoint holds the model (cat.mm.config).
    starting = {"checkpoint": cfg.checkpoint, "model.pretrained": cfg.model.pretrained}
    for name, path in () if resumes(cfg, LAST_CHECKPOINT) else starting.items():
        # checkpoint= may be a URL or model-zoo name: mmengine fetches it through cat's safe loader.
        remote = name == "checkpoint" and isinstance(path, str) and "://" in path
        if isinstance(path, str) and not remote:
            problems += [problem] if (problem := starting_file_problem(cfg, name, path)) else []
    if not (isinstance(cfg.data.root, str) and os.path.isdir(cfg.data.root)):
        problems.append(
            f"data.root={cfg.data.root}: not a folder with the dataset "
            "(tools/make_toy_coco.py / tools/make_toy_ade.py write toy ones)"
        )
    if (problem := check_writable(cfg.output_dir, "output_dir")) is not None:
        problems.append(problem)
    problems += _backbone_kwargs_problems(cfg)
    if problems:
        raise ConfigError(problems)
    from .config import backbone_problems  # loads the packaged base config: only once the keys are valid

    problems += backbone_problems(cfg.model)
    if problems:
        raise ConfigError(problems)
    return cfg
