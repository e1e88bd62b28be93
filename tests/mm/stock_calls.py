"""Stock mmdet/mmseg calls on stock-style checkpoints, run as ``python -m tests.mm.stock_calls {plain|cat} DIR`` in a
fresh interpreter: what they return, as JSON on stdout. ``cat`` imports ``cat.mm`` first, as a user's config or
script may; everything after that line is what a stock user writes."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

if sys.argv[1] == "cat":
    import cat.mm  # noqa: F401

from mmdet.apis import inference_detector, init_detector  # noqa: E402
from mmengine.runner import load_checkpoint  # noqa: E402
from mmseg.apis import inference_model, init_model  # noqa: E402

folder = Path(sys.argv[2])
image = str(folder / "image.jpg")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    detector = init_detector(str(folder / "det.py"), str(folder / "det_mmdet2.pth"), device="cpu")
    detections = inference_detector(detector, image).pred_instances
    segmentor = init_model(str(folder / "seg.py"), str(folder / "seg_mmseg0.pth"), device="cpu")
    segmentation = inference_model(segmentor, image).pred_sem_seg.data
    reloaded = load_checkpoint(segmentor, str(folder / "seg_mmseg0.pth"), map_location="cpu")
print(
    json.dumps(
        {
            "det_meta": {k: list(map(str, v)) for k, v in detector.dataset_meta.items()},
            "det_scores": detections.scores[:10].tolist(),
            "det_boxes": detections.bboxes[:10].tolist(),
            "seg_meta": {k: json.loads(json.dumps(v, default=list)) for k, v in segmentor.dataset_meta.items()},
            "seg_classes_per_pixel": torch.bincount(segmentation.flatten(), minlength=3).tolist(),
            "load_checkpoint_meta": sorted(reloaded["meta"]),
            "warnings": sorted(
                {str(w.message).splitlines()[0] for w in caught if "saved in the checkpoint" in str(w.message)}
            ),
        }
    )
)
