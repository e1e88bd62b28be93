"""Run a detection or segmentation job on mmengine's Runner and write ``metrics.json``."""
from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig

from cat.engine.checkpoint import atomic_write_json
from cat.engine.dist import init_distributed
from cat.engine.launch import prepare_output_dir

from .backbone import register_backbones
from .safe_load import allow_mmengine_checkpoints

__all__ = ["run_mm"]


def _task(task: str):
    if task == "det":
        from mmdet.utils import register_all_modules

        from .det import DET_METRICS, build_det_config
        return register_all_modules, build_det_config, DET_METRICS
    if task == "seg":
        from mmseg.utils import register_all_modules

        from .seg import SEG_METRICS, build_seg_config
        return register_all_modules, build_seg_config, SEG_METRICS
    raise ValueError(f"task must be 'det' or 'seg', got {task!r}")


def run_mm(cfg: DictConfig, task: str) -> dict[str, Any]:
    """Train (auto-resuming from ``output_dir``) or evaluate; returns what metrics.json holds."""
    if cfg.mode not in ("train", "eval"):
        raise ValueError(f"mode must be train or eval; got {cfg.mode!r}")
    if cfg.mode == "eval" and not cfg.checkpoint:
        raise ValueError("mode=eval needs checkpoint=PATH (a detector/segmentor checkpoint)")
    register_all_modules, build_config, metric_keys = _task(task)
    # Our own process group first: mmengine's init would call torch.cuda.set_device on CPU machines.
    env = init_distributed(cfg.device)
    output_dir, log = prepare_output_dir(cfg, env)
    allow_mmengine_checkpoints()
    register_all_modules(init_default_scope=True)
    register_backbones()
    from mmengine.runner import Runner

    mm = build_config(cfg, env, output_dir)
    if env.is_main:
        mm.dump(os.path.join(output_dir, "mm_config.py"))
    try:
        runner = Runner.from_cfg(mm)
        if cfg.mode == "train":
            runner.train()
        results = runner.test()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    metrics = {key: None if results.get(mm_key) is None else float(results[mm_key])  # numpy scalars -> JSON
               for key, mm_key in metric_keys.items()}
    metrics.update({"mode": cfg.mode, "checkpoint": cfg.checkpoint})
    if env.is_main:
        atomic_write_json(os.path.join(output_dir, "metrics.json"), metrics)
    log.info("%s %s: %s", task, cfg.mode, {k: v for k, v in metrics.items() if v is not None})
    return metrics
