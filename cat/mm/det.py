"""Detection jobs: the mmdet config of a Hydra ``configs/det`` composition."""

from __future__ import annotations

import os

from mmengine.config import Config
from omegaconf import DictConfig

from cat.errors import DataError
from cat.runtime.dist import DistEnv

from .config import apply_common, configure_loader, task_base

__all__ = ["build_det_config", "DET_METRICS"]

# metrics.json keys <- mmdet's CocoMetric keys
DET_METRICS = {
    f"{kind}_mAP{suffix}": f"coco/{kind}_mAP{suffix}" for kind in ("bbox", "segm") for suffix in ("", "_50", "_75")
}


def _pipelines(mm: Config, data: DictConfig) -> None:
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


def build_det_config(cfg: DictConfig, env: DistEnv, output_dir: str) -> Config:
    data = cfg.data
    mm, classes, root = task_base(
        cfg, "COCO layout (train2017/, val2017/, annotations/instances_*.json); tools/make_toy_coco.py writes one"
    )
    if classes is not None:
        mm.model.roi_head.bbox_head.num_classes = len(classes)
        mm.model.roi_head.mask_head.num_classes = len(classes)
    _pipelines(mm, data)
    for split, loader in (("train", "train_dataloader"), ("val", "val_dataloader"), ("val", "test_dataloader")):
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
        configure_loader(mm[loader], cfg.batch_size if split == "train" else 1, cfg.workers, dataset)
    for evaluator in ("val_evaluator", "test_evaluator"):
        mm[evaluator].ann_file = os.path.join(root, "annotations", "instances_val2017.json")
    sched = cfg.schedule
    mm.train_cfg = {"type": "EpochBasedTrainLoop", "max_epochs": sched.epochs, "val_interval": sched.val_interval}
    mm.param_scheduler = [
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
    mm.auto_scale_lr = {"enable": False, "base_batch_size": sched.total_batch}
    return apply_common(mm, cfg, env, output_dir)
