"""Segmentation (``train_seg.py``): SemanticFPN/UperNet mmseg configs on an ADE20K-format dataset, as an
:class:`MMTask`."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from cat.errors import DataError

from .schema import SegConfig
from .task import MMTask

if TYPE_CHECKING:
    from mmengine.config import Config

__all__ = ["SEG", "SEG_METRICS"]

SEG_METRICS = {"mIoU": "mIoU", "mAcc": "mAcc", "aAcc": "aAcc"}  # metrics.json keys <- IoUMetric keys


def _register_modules() -> None:
    from mmseg.utils import register_all_modules

    register_all_modules(init_default_scope=True)


def _set_classes(mm: Config, classes: tuple[str, ...] | None) -> None:
    num_classes = 150 if classes is None else len(classes)
    mm.model.decode_head.num_classes = num_classes
    if mm.model.get("auxiliary_head") is not None:
        mm.model.auxiliary_head.num_classes = num_classes


def _pipelines(mm: Config, cfg: SegConfig) -> None:
    data = cfg.data
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


def _dataset(mm: Config, root: str, split: str, classes: tuple[str, ...] | None) -> dict[str, Any]:
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
    return dataset


def _test_time_augmentation(mm: Config, cfg: SegConfig, root: str) -> None:
    if cfg.mode == "eval" and cfg.tta:  # multi-scale + flip testing
        from mmengine.config import ConfigDict

        mm.test_dataloader.dataset.pipeline = mm.tta_pipeline
        mm.model = ConfigDict({"type": "SegTTAModel", "module": mm.model.to_dict()})


def _schedule(cfg: SegConfig) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    sched = cfg.schedule
    train_cfg = {"type": "IterBasedTrainLoop", "max_iters": sched.iters, "val_interval": sched.val_interval}
    warmup = (
        [{"type": "LinearLR", "start_factor": 1e-6, "by_epoch": False, "begin": 0, "end": sched.warmup_iters}]
        if sched.warmup_iters
        else []
    )
    poly = {
        "type": "PolyLR",
        "eta_min": 0.0,
        "power": sched.poly_power,
        "by_epoch": False,
        "begin": sched.warmup_iters,
        "end": sched.iters,
    }
    return train_cfg, [*warmup, poly]


SEG = MMTask(
    name="seg",
    what="segmentation",
    stack=("mmengine", "mmcv", "mmseg"),
    schema=SegConfig,
    register_modules=_register_modules,
    layout="ADE20K layout (images/training, annotations/training, ...); tools/make_toy_ade.py writes one",
    loaders=(("training", "train_dataloader"), ("validation", "val_dataloader"), ("validation", "test_dataloader")),
    metrics=SEG_METRICS,
    set_classes=_set_classes,
    pipelines=_pipelines,
    dataset=_dataset,
    schedule=_schedule,
    finish=_test_time_augmentation,
)
