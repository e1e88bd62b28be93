"""Shared by the Hydra entry points (train_cls.py, train_det.py, train_seg.py)."""
from __future__ import annotations

import logging
import os
import sys

from omegaconf import DictConfig, OmegaConf

from .dist import DistEnv, barrier, broadcast_object
from .logger import setup_logging

__all__ = ["quiet_hydra_on_other_ranks", "prepare_output_dir"]


def quiet_hydra_on_other_ranks() -> None:
    """Only rank 0 lets Hydra write its run folder; under torchrun the other ranks would race on it."""
    if int(os.environ.get("RANK", "0")) > 0:
        sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=."]


def prepare_output_dir(cfg: DictConfig, env: DistEnv) -> tuple[str, logging.Logger]:
    """The run's output folder (created, with the resolved ``config.yaml``) and its logger.

    All ranks get rank 0's absolute path, even if ``output_dir`` interpolates a timestamp.
    """
    output_dir = broadcast_object(os.path.abspath(cfg.output_dir))
    if env.is_main:
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "config.yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(cfg, resolve=True))
    barrier()
    return output_dir, setup_logging(env.is_main, os.path.join(output_dir, "log.txt"))
