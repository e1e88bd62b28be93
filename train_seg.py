#!/usr/bin/env python
"""Semantic segmentation (mmseg SemanticFPN / UperNet) with cat backbones.

    python tools/make_toy_ade.py data/toy_ade && python train_seg.py data.root=data/toy_ade
    torchrun --nproc_per_node=8 train_seg.py experiment=fpn_ca_pvt_t_40k data.root=/data/ade/ADEChallengeData2016 \\
        model.pretrained=outputs/cls/ca_pvt_t/best.pth
    python train_seg.py experiment=upernet_ca_swin_t_160k mode=eval checkpoint=seg.pth tta=true data.root=...

Configs live in configs/seg (Hydra); see README.md.
"""

from __future__ import annotations

import gc

# The collector stays off while torch, timm and the rest load (their long-lived objects would be walked over
# and over); hydra_entry turns it back on with them set aside (cat/runtime/entry.py says why).
gc.disable()

from omegaconf import DictConfig

from cat.mm import SEG, run_mm
from cat.runtime import hydra_entry


@hydra_entry("configs/seg", schema="seg")
def main(cfg: DictConfig) -> None:
    run_mm(cfg, SEG)


if __name__ == "__main__":
    main()
