#!/usr/bin/env python
"""Object detection and instance segmentation (mmdet Mask R-CNN) with cat backbones.

    python tools/make_toy_coco.py data/toy_coco && python train_det.py data.root=data/toy_coco
    torchrun --nproc_per_node=8 train_det.py experiment=mask_rcnn_ca_pvt_t_1x data.root=/data/coco \\
        model.pretrained=outputs/cls/ca_pvt_t/best.pth
    python train_det.py experiment=mask_rcnn_ca_pvt_t_1x mode=eval checkpoint=det.pth data.root=/data/coco

Configs live in configs/det (Hydra); see README.md.
"""

from __future__ import annotations

import gc

# The collector stays off while torch, timm and the rest load (their long-lived objects would be walked over
# and over); hydra_entry turns it back on with them set aside (cat/runtime/entry.py says why).
gc.disable()

from omegaconf import DictConfig

from cat.mm import DET, run_mm
from cat.runtime import hydra_entry


@hydra_entry("configs/det", schema="det")
def main(cfg: DictConfig) -> None:
    run_mm(cfg, DET)


if __name__ == "__main__":
    main()
