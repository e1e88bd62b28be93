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

import os
import sys

import hydra
from omegaconf import DictConfig

from cat.engine.classification import run


def _quiet_hydra_on_other_ranks() -> None:
    """Only rank 0 lets Hydra write its run folder; the other ranks would race on it."""
    if int(os.environ.get("RANK", "0")) > 0:
        sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=."]


@hydra.main(config_path="configs/cls", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    _quiet_hydra_on_other_ranks()
    main()
