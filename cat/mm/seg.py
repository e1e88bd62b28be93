"""Segmentation jobs: the mmseg config of a Hydra ``configs/seg`` composition."""

from __future__ import annotations

import os

from mmengine.config import Config, ConfigDict
from omegaconf import DictConfig

from cat.errors import DataError
from cat.runtime.dist import DistEnv

from .config import apply_common, configure_loader, task_base

__all__ = ["build_seg_config", "SEG_METRICS"]

SEG_METRICS = {"mIoU": "mIoU", "mAcc": "mAcc", "aAcc": "aAcc"}  # metrics.json keys <- IoUMetric keys


def _pipelines(mm: Config, data: DictConfig) -> None:
    crop = tuple(data.crop_size)
    mm.model.data_preprocessor.size = crop
    for step in mm.train_pipeline:
        if step["type"] == "RandomResize":
            step["scale"] = tuple(data.scale)
        if step["type"] == "RandomCrop":
            step["crop_size"] = crop
    for step in mm.test_pipeline:
        if step["type"] == "Resize":
            step["scale"] = tuple(data.scale)


def _palette(n: int) -> list[list[int]]:
    """Distinct display colours for ``n`` classes (fixed, so visualisations are stable)."""
    return [[(37 * i + 80) % 256, (91 * i + 40) % 256, (151 * i + 160) % 256] for i in range(n)]


def build_seg_config(cfg: DictConfig, env: DistEnv, output_dir: str) -> Config:
    data = cfg.data
    mm, classes, root = task_base(
        cfg, "ADE20K layout (images/training, annotations/training, ...); tools/make_toy_ade.py writes one"
    )
    num_classes = 150 if classes is None else len(classes)
    mm.model.decode_head.num_classes = num_classes
    if mm.model.get("auxiliary_head") is not None:
        mm.model.auxiliary_head.num_classes = num_classes
    _pipelines(mm, data)
    for split, loader in (
        ("training", "train_dataloader"),
        ("validation", "val_dataloader"),
        ("validation", "test_dataloader"),
    ):
        for kind in ("images", "annotations"):
            folder = os.path.join(root, kind, split)
            if not os.path.isdir(folder):
                raise DataError(f"ADE20K folder not found: {folder}")
        dataset = {
            "data_root": root,
            "data_prefix": {"img_path": f"images/{split}", "seg_map_path": f"annotations/{split}"},
            "pipeline": mm.train_pipeline if split == "training" else mm.test_pipeline,
        }
        if classes is not None:  # ADE20KDataset only accepts subsets of its 150 classes
            dataset.update(
                {
                    "type": "BaseSegDataset",
                    "img_suffix": ".jpg",
                    "seg_map_suffix": ".png",
                    "reduce_zero_label": True,
                    "metainfo": {"classes": classes, "palette": _palette(len(classes))},
                }
            )
        configure_loader(mm[loader], cfg.batch_size if split == "training" else 1, cfg.workers, dataset)
    if cfg.mode == "eval" and cfg.tta:  # multi-scale + flip testing
        mm.test_dataloader.dataset.pipeline = mm.tta_pipeline
        mm.model = ConfigDict({"type": "SegTTAModel", "module": mm.model.to_dict()})
    sched = cfg.schedule
    mm.train_cfg = {"type": "IterBasedTrainLoop", "max_iters": sched.iters, "val_interval": sched.val_interval}
    mm.param_scheduler = (
        [{"type": "LinearLR", "start_factor": 1e-6, "by_epoch": False, "begin": 0, "end": sched.warmup_iters}]
        if sched.warmup_iters
        else []
    ) + [
        {
            "type": "PolyLR",
            "eta_min": 0.0,
            "power": sched.poly_power,
            "by_epoch": False,
            "begin": sched.warmup_iters,
            "end": sched.iters,
        }
    ]
    return apply_common(mm, cfg, env, output_dir)
