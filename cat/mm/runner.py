"""A detection or segmentation job: mmengine's Runner as the body of cat's job lifecycle."""

from __future__ import annotations

import logging
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from cat.errors import ConfigError
from cat.runtime import DistEnv, Rule, RunFolder, run_job, use_sweep_cell_dir, validate_config

from .backbone import register_backbones
from .safe_load import check_last_checkpoint, check_weights_match, install_safe_checkpoint_io

__all__ = ["run_mm", "MM_RULES", "check_mm_config"]

MM_RULES = (
    Rule("mode", "str", choices=("train", "eval")),
    Rule("batch_size", "int", min=1),
    Rule("workers", "int", min=0),
    Rule("seed", "int", min=0),
    Rule("device", "str", choices=("auto", "cpu", "cuda")),
    Rule("checkpoint", "str", nullable=True),
    Rule("model.pretrained", "str", nullable=True),
    *(Rule(key, "bool") for key in ("resume", "debug", "amp.enabled", "find_unused_parameters", "strict_load")),
    Rule("amp.dtype", "str", choices=("bf16", "fp16")),
    Rule("save.interval", "int", min=1),
    Rule("save.keep_last", "int", min=1),
    Rule("log_interval", "int", min=1),
    Rule("logger.wandb.mode", "str", choices=("auto", "online", "offline", "disabled")),
    Rule("schedule.optim.lr", "float", min=0, exclusive_min=True),
    Rule("schedule.optim.weight_decay", "float", min=0),
)


def check_mm_config(cfg: DictConfig) -> None:
    """Every problem with a detection/segmentation config, before anything is built (ConfigError)."""
    problems = []
    if cfg.mode == "eval" and not cfg.checkpoint:
        problems.append("mode=eval needs checkpoint=PATH (a detector/segmentor checkpoint)")
    for key in ("checkpoint", "model.pretrained"):
        path = OmegaConf.select(cfg, key)
        # checkpoint= may be a URL or model-zoo name: mmengine fetches it through cat's safe loader.
        remote = key == "checkpoint" and isinstance(path, str) and "://" in path
        if isinstance(path, str) and not remote and not os.path.isfile(path):
            problems.append(f"{key}={path}: no such file")
    if not (isinstance(cfg.data.root, str) and os.path.isdir(cfg.data.root)):
        problems.append(
            f"data.root={cfg.data.root}: not a folder with the dataset "
            "(tools/make_toy_coco.py / tools/make_toy_ade.py write toy ones)"
        )
    validate_config(cfg, MM_RULES, problems)


def _task(task: str):
    if task == "det":
        from mmdet.utils import register_all_modules

        from .det import DET_METRICS, build_det_config

        return register_all_modules, build_det_config, DET_METRICS
    if task == "seg":
        from mmseg.utils import register_all_modules

        from .seg import SEG_METRICS, build_seg_config

        return register_all_modules, build_seg_config, SEG_METRICS
    raise ConfigError(f"task must be 'det' or 'seg', got {task!r}")


def run_mm(cfg: DictConfig, task: str) -> dict[str, Any]:
    """Train (auto-resuming from ``output_dir``) or evaluate; returns what metrics.json holds.

    Training writes into ``output_dir``, eval into ``output_dir/eval``. On SIGTERM a training run
    saves ``iter_N.pth`` after the running iteration and returns with ``preempted: true``.
    """
    use_sweep_cell_dir(cfg)
    check_mm_config(cfg)
    register_all_modules, build_config, metric_keys = _task(task)

    def body(env: DistEnv, folder: RunFolder) -> dict[str, Any]:
        # cat's process group comes first (run_job): mmengine's own init would call torch.cuda.set_device on CPU.
        install_safe_checkpoint_io()
        register_all_modules(init_default_scope=True)
        register_backbones()
        from mmengine.runner import Runner

        from .preemption import Preempted

        mm = build_config(cfg, env, folder.path)
        if mm.resume and mm.load_from is None:  # mmengine's auto-resume follows last_checkpoint
            check_last_checkpoint(folder.path)
        folder.write_config(cfg)
        if env.is_main:
            mm.dump(folder.file("mm_config.py"))
        runner = Runner.from_cfg(mm)
        if cfg.mode == "eval" and cfg.strict_load:
            check_weights_match(runner.model, cfg.checkpoint)
        if env.is_main:  # mmengine's log lines in log.txt too, as they happen
            handler = logging.FileHandler(folder.file("log.txt"))
            handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
            runner.logger.addHandler(handler)
        try:
            if cfg.mode == "train":
                runner.train()
            results = runner.test()
        except Preempted as stop:
            folder.log.info(
                "stop requested (SIGTERM): saved iteration %d to %s; rerun the same command to resume",
                stop.iteration,
                stop.checkpoint,
            )
            return {"mode": cfg.mode, "preempted": True, "iteration": stop.iteration, "checkpoint": stop.checkpoint}
        metrics = {
            key: None if results.get(mm_key) is None else float(results[mm_key])  # numpy -> JSON
            for key, mm_key in metric_keys.items()
        }
        metrics.update({"mode": cfg.mode, "checkpoint": cfg.checkpoint})
        folder.log.info("%s %s: %s", task, cfg.mode, {k: v for k, v in metrics.items() if v is not None})
        return metrics

    return run_job(cfg, body)
