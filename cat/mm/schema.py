"""The detection (``train_det.py``) and segmentation (``train_seg.py``) configs: typed schemas on
top of :class:`~cat.runtime.schema.JobConfig` (their checks: :mod:`cat.mm.checks`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cat.runtime.job_config import JobConfig, NetworkConfig, SaveConfig
from cat.runtime.schema import FIXED, FREE, GROW, key, register_schema, section

__all__ = ["MMConfig", "MMModelConfig", "DetConfig", "SegConfig"]


@dataclass
class BackboneConfig(NetworkConfig):
    name: str = key("a registered model with forward_intermediates (cat's or timm's)")
    out_indices: list[int] = key(
        "the feature levels (timm's feature_info) whose maps feed the neck, at the strides the heads are built "
        "for (4, 8, 16, 32; a timm ResNet's levels 1-4)",
        min=0,
    )
    out_norm: bool = key("normalise each output feature map")


@dataclass
class MMModelConfig:
    base: str = key(
        "the OpenMMLab config it starts from: one mmdet or mmseg ships (mmdet::mask_rcnn/...py, resolved inside its "
        "config tree), or a path to your own (an mmengine config is Python: it runs when loaded)"
    )
    backbone: BackboneConfig = section(BackboneConfig, "cat's backbone in it")
    pretrained: str | None = key(
        "ImageNet checkpoint of the backbone (train_cls.py output or release format)", resume=FREE
    )
    overrides: dict[str, Any] = key("dotted keys into the model config, e.g. {neck.out_channels: 128}")


@dataclass
class MMOptimConfig:
    type: str = key("an optimizer type mmengine knows (AdamW, SGD, ...)")
    lr: float = key("learning rate at the paper's total batch", min=0, max=1e6, exclusive_min=True)
    weight_decay: float = key("weight decay (none on no_decay_keys)", min=0)
    betas: list[float] = key("Adam betas", min=0, max=1, exclusive_max=True)
    clip_grad: float | None = key("max gradient norm; null: no clipping", min=0, exclusive_min=True)
    no_decay_keys: list[str] = key("parameter-name parts without weight decay")


@dataclass
class MMSaveConfig(SaveConfig):
    keep_last: int = key("iteration/epoch checkpoints kept", min=1)
    interval: int = key("epochs (epoch-based schedules) or iterations between checkpoints", min=1)


@dataclass
class MMDataConfig:
    """What both tasks' datasets have. Which dataset is the config group's choice (data=coco, data=toy_ade): its
    layout is the task's (:class:`~cat.mm.task.MMTask`), so a run's data section names no dataset of its own."""

    root: str | None = key(
        "the dataset folder (COCO: train2017/, val2017/, annotations/; ADE20K: images/, annotations/)",
        resume=FREE,
        in_run_name=False,
    )
    classes: list[str] | None = key(
        "a subset of the dataset's classes (one or more names); null: all (COCO's 80, ADE20K's 150)", length=(1, 256)
    )


@dataclass
class MMScheduleConfig:
    """What both tasks' schedules have; each task's extends it (epochs or iterations)."""

    val_interval: int = key("epochs or iterations between evaluations", min=1, resume=FREE)
    warmup_iters: int = key("linear warm-up iterations", min=0)
    optim: MMOptimConfig = section(MMOptimConfig, "the optimizer")


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
    # Each task's own (DetConfig, SegConfig) declares these again with its own section.
    data: MMDataConfig = section(MMDataConfig, "the dataset", resume=FIXED)
    schedule: MMScheduleConfig = section(MMScheduleConfig, "the schedule", resume=FIXED)
    mm: dict[str, Any] = key("extra mmengine config options, dotted keys: {train_cfg.val_interval: 2}")


@dataclass
class DetDataConfig(MMDataConfig):
    img_scale: list[int] = key("test and 1x-train scale [long, short]", min=1)
    multiscale_train: list[int] | None = key("[480, 800]: random shorter side in that range (3x)", min=1)


@dataclass
class DetScheduleConfig(MMScheduleConfig):
    epochs: int = key("training epochs", min=1, max=100_000, resume=GROW)
    steps: list[int] = key("epochs after which lr drops 10x", min=1)
    val_interval: int = key("epochs between evaluations", min=1, resume=FREE)
    warmup_ratio: float = key("warm-up start lr / lr", min=0, max=1, exclusive_min=True)
    total_batch: int = key("the paper's total batch (lr is for it)", min=1)


@dataclass
class DetConfig(MMConfig):
    data: DetDataConfig = section(DetDataConfig, "the COCO-format dataset", resume=FIXED)
    schedule: DetScheduleConfig = section(DetScheduleConfig, "the epoch schedule", resume=FIXED)


@dataclass
class SegDataConfig(MMDataConfig):
    crop_size: list[int] = key("training crop [height, width]", min=1)
    scale: list[int] = key("resize base [long, short] (train: ratio 0.5-2.0) and test scale", min=1)


@dataclass
class SegScheduleConfig(MMScheduleConfig):
    iters: int = key("training iterations", min=1, max=10**9, resume=GROW)
    val_interval: int = key("iterations between evaluations", min=1, resume=FREE)
    poly_power: float = key("poly decay power", min=0, exclusive_min=True)


@dataclass
class SegConfig(MMConfig):
    data: SegDataConfig = section(SegDataConfig, "the ADE20K-format dataset", resume=FIXED)
    schedule: SegScheduleConfig = section(SegScheduleConfig, "the iteration schedule", resume=FIXED)
    tta: bool = key("eval: multi-scale + flip testing")


register_schema("det", DetConfig)
register_schema("seg", SegConfig)
