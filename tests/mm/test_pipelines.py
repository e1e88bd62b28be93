"""Every train pipeline of the Table 3/4 presets at volume: generated COCO/ADE images through the
real mmdet/mmseg transforms (no model), each discrete choice forced once, then random draws."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from cat.runtime.dist import DistEnv
from tests.conftest import REPO, compose_config, mm_builder

pytest.importorskip("mmdet", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")

RANDOM_DRAWS = 40


def _paper_presets(task: str) -> list[str]:
    return sorted(
        p.stem for p in (REPO / "configs" / task / "experiment").glob("*.yaml") if not p.stem.startswith("toy")
    )


def _distinct_pipelines(task: str, root, tmp_path) -> dict[str, list[dict]]:
    """The distinct train pipelines the task's paper presets build, keyed by the first preset using each."""

    build = mm_builder(task)
    pipelines: dict[str, tuple[str, list[dict]]] = {}
    # The toy sets' own classes (COCO's 80 would filter every toy image out); sizes stay the presets'.
    classes = "[circle,square,triangle]" if task == "det" else "[background,circle,square,triangle]"
    for experiment in _paper_presets(task):
        cfg = compose_config(task, f"experiment={experiment}", f"data.root={root}", f"data.classes={classes}")
        mm = build(cfg, DistEnv(), str(tmp_path))
        pipeline = mm.train_dataloader.dataset.pipeline
        pipelines.setdefault(repr(pipeline), (experiment, mm))
    return {experiment: mm for experiment, mm in pipelines.values()}


def _forced_variants(pipeline: list[dict]) -> list[list[dict]]:
    """The pipeline once per discrete choice its random steps can make: each scale of a
    RandomChoiceResize, each end of a RandomResize's ratio range and of PhotoMetricDistortion's
    contrast and saturation ranges, and flips always on."""
    variants = []
    for i, step in enumerate(pipeline):
        if step["type"] == "RandomChoiceResize":
            choices = [{**step, "scales": [scale]} for scale in step["scales"]]
        elif step["type"] == "RandomResize" and step.get("ratio_range"):
            choices = [{**step, "ratio_range": (r, r)} for r in step["ratio_range"]]
        elif step["type"] == "RandomFlip":
            choices = [{**step, "prob": 1.0}]
        elif step["type"] == "PhotoMetricDistortion":  # each end of its contrast and saturation ranges
            ranges = {key: step.get(key, (0.5, 1.5)) for key in ("contrast_range", "saturation_range")}
            choices = [{**step, key: (end, end)} for key, ends in ranges.items() for end in ends]
        else:
            continue
        for choice in choices:
            variant = copy.deepcopy(pipeline)
            variant[i] = choice
            variants.append(variant)
    return variants


def _check_det(sample: dict) -> None:
    image = sample["inputs"]
    assert image.dtype == torch.uint8 and image.shape[0] == 3
    assert max(image.shape[1:]) <= 1333 and min(image.shape[1:]) <= 800
    instances = sample["data_samples"].gt_instances
    assert instances.bboxes.shape[1] == 4 and len(instances.masks) == len(instances.bboxes)
    boxes = instances.bboxes.tensor
    assert (boxes[:, 2:] <= torch.tensor(image.shape[1:][::-1]) + 1e-3).all() and (boxes >= -1e-3).all()


def _check_seg(sample: dict, crop: tuple[int, int]) -> None:
    image = sample["inputs"]
    assert image.dtype == torch.uint8 and image.shape[0] == 3
    assert image.shape[1] <= crop[0] and image.shape[2] <= crop[1]
    labels = sample["data_samples"].gt_sem_seg.data
    assert labels.shape[1:] == image.shape[1:]
    values = set(labels.unique().tolist())
    assert values <= set(range(150)) | {255}


@pytest.mark.slow
@pytest.mark.parametrize("task", ["det", "seg"])
def test_paper_train_pipelines_at_volume(task, toy_coco, toy_ade, tmp_path):
    if task == "det":
        from mmdet.registry import DATASETS
        from mmdet.utils import register_all_modules
    else:
        from mmseg.registry import DATASETS
        from mmseg.utils import register_all_modules
    register_all_modules(init_default_scope=True)
    pipelines = _distinct_pipelines(task, toy_coco if task == "det" else toy_ade, tmp_path)
    assert pipelines, f"no {task} presets"
    np.random.seed(0)
    for experiment, mm in pipelines.items():
        dataset_cfg = mm.train_dataloader.dataset
        crop = tuple(mm.get("crop_size", (512, 512)))
        check = _check_det if task == "det" else (lambda sample, crop=crop: _check_seg(sample, crop))
        for variant in [dataset_cfg.pipeline, *_forced_variants(dataset_cfg.pipeline)]:
            dataset = DATASETS.build({**dataset_cfg, "pipeline": variant})
            draws = RANDOM_DRAWS if variant is dataset_cfg.pipeline else len(dataset)
            for i in range(draws):
                try:
                    check(dataset[i % len(dataset)])
                except AssertionError as error:
                    raise AssertionError(f"{experiment}: {variant}: {error}") from None
