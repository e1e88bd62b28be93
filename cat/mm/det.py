"""Detection (``train_det.py``): Mask R-CNN-style mmdet configs on a COCO-format dataset, as an :class:`MMTask`."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from cat.errors import DataError

from .schema import DetConfig
from .task import MMTask

if TYPE_CHECKING:
    from mmengine.config import Config

__all__ = ["DET", "DET_METRICS"]

# metrics.json keys <- mmdet's CocoMetric keys
DET_METRICS = {
    f"{kind}_mAP{suffix}": f"coco/{kind}_mAP{suffix}" for kind in ("bbox", "segm") for suffix in ("", "_50", "_75")
}


def _register_modules() -> None:
    from mmdet.utils import register_all_modules

    register_all_modules(init_default_scope=True)


# The heads that classify a detection into the dataset's classes, wherever a detector holds them: a single-stage
# model's bbox_head, a two-stage model's roi_head.bbox_head and mask_head, a cascade's lists of them. The region
# proposal head (one class: object) and HTC's semantic head (stuff classes) are not among them.
CLASS_HEADS = ("bbox_head", "mask_head", "mask_iou_head")


def _set_classes(mm: Config, classes: tuple[str, ...] | None) -> None:
    if classes is None:
        return
    pending: list[object] = [mm.model]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                heads = value if isinstance(value, list) else [value]
                for head in heads if key in CLASS_HEADS else ():
                    if isinstance(head, dict) and "num_classes" in head:
                        head["num_classes"] = len(classes)
                pending.append(value)
        elif isinstance(node, list):
            pending += node


def _pipelines(mm: Config, cfg: DetConfig) -> None:
    data = cfg.data
    scale = tuple(data.img_scale)
    for pipeline in (mm.train_pipeline, mm.test_pipeline):
        for step in pipeline:
            if step["type"] == "Resize":
                step["scale"] = scale
    if data.multiscale_train:
        # Swin's 3x recipe: shorter side 480-800 (step 32), longer side at most 1333.
        shorts = list(range(data.multiscale_train[0], data.multiscale_train[1] + 1, 32))
        resize = {"type": "RandomChoiceResize", "scales": [(scale[0], s) for s in shorts], "keep_ratio": True}
        mm.train_pipeline = [resize if step["type"] == "Resize" else step for step in mm.train_pipeline]


def _dataset(mm: Config, root: str, split: str, classes: tuple[str, ...] | None) -> dict[str, Any]:
    ann = os.path.join(root, "annotations", f"instances_{split}2017.json")
    if not os.path.isfile(ann):
        raise DataError(f"COCO annotations not found: {ann}")
    dataset = {
        "data_root": root,
        "ann_file": ann,
        "data_prefix": {"img": f"{split}2017/"},
        "pipeline": mm.train_pipeline if split == "train" else mm.test_pipeline,
    }
    if classes is not None:
        dataset["metainfo"] = {"classes": classes}
    return dataset


def _evaluators(mm: Config, cfg: DetConfig, root: str) -> None:
    for evaluator in ("val_evaluator", "test_evaluator"):
        mm[evaluator].ann_file = os.path.join(root, "annotations", "instances_val2017.json")
    mm.auto_scale_lr = {"enable": False, "base_batch_size": cfg.schedule.total_batch}


def _schedule(cfg: DetConfig) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    sched = cfg.schedule
    train_cfg = {"type": "EpochBasedTrainLoop", "max_epochs": sched.epochs, "val_interval": sched.val_interval}
    return train_cfg, [
        {
            "type": "LinearLR",
            "start_factor": sched.warmup_ratio,
            "by_epoch": False,
            "begin": 0,
            "end": sched.warmup_iters,
        },
        {
            "type": "MultiStepLR",
            "by_epoch": True,
            "begin": 0,
            "end": sched.epochs,
            "milestones": list(sched.steps),
            "gamma": 0.1,
        },
    ]


DET = MMTask(
    name="det",
    what="detection",
    stack=("mmengine", "mmcv", "mmdet"),
    schema=DetConfig,
    register_modules=_register_modules,
    layout="COCO layout (train2017/, val2017/, annotations/instances_*.json); tools/make_toy_coco.py writes one",
    loaders=(("train", "train_dataloader"), ("val", "val_dataloader"), ("val", "test_dataloader")),
    metrics=DET_METRICS,
    set_classes=_set_classes,
    pipelines=_pipelines,
    dataset=_dataset,
    schedule=_schedule,
    finish=_evaluators,
)
