#!/usr/bin/env python
"""Image classification with circulant-attention (and baseline) models.

    python train_cls.py                                             # quick-start on the bundled digits
    python train_cls.py experiment=ca_deit_s data.root=/data/imagenet
    torchrun --nproc_per_node=8 train_cls.py experiment=ca_deit_s data.root=/data/imagenet
    python train_cls.py experiment=ca_deit_s mode=eval checkpoint=ca_deit_s.pth data.root=/data/imagenet
    python train_cls.py experiment=ca_deit_t mode=throughput throughput.batch_size=256

Configs live in configs/cls (Hydra); see README.md for the keys.
"""

from __future__ import annotations

import gc

# The collector stays off while torch, timm and the rest load (their long-lived objects would be walked over
# and over); hydra_entry turns it back on with them set aside (cat/runtime/entry.py says why).
gc.disable()

from omegaconf import DictConfig

from cat.classification.job import run
from cat.runtime import hydra_entry


@hydra_entry("configs/cls", schema="cls")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
