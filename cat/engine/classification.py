"""The classification job behind ``train_cls.py``: its config checks, and the train (:func:`fit`),
eval and throughput modes run through cat's one job lifecycle."""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig

from cat.data import build_dataset
from cat.errors import ConfigError, UserError
from cat.runtime import DistEnv, Rule, RunFolder, run_dir_for, run_job, use_sweep_cell_dir, validate_config
from cat.runtime.logger import run_id_problem

from .builders import build_model, num_classes_of, val_loader
from .fit import fit
from .train import evaluate, measure_throughput

__all__ = ["run", "CLS_RULES", "check_config"]

CLS_RULES = (
    Rule("mode", "str", choices=("train", "eval", "throughput")),
    Rule("epochs", "int", min=1),
    Rule("batch_size", "int", min=1),
    Rule("lr", "float", min=0, exclusive_min=True),
    Rule("seed", "int", min=0),
    Rule("workers", "int", min=0),
    Rule("log_interval", "int", min=1),
    Rule("device", "str", choices=("auto", "cpu", "cuda")),
    Rule("checkpoint", "str", nullable=True),
    *(
        Rule(key, "bool")
        for key in (
            "resume",
            "strict_load",
            "compile",
            "channels_last",
            "deterministic",
            "pin_memory",
            "debug",
            "amp.enabled",
            "ema.enabled",
        )
    ),
    Rule("amp.dtype", "str", choices=("bf16", "fp16")),
    Rule("ema.decay", "float", min=0, max=1),
    Rule("data.name", "str", choices=("imagenet", "folder", "digits", "synthetic")),
    Rule("data.img_size", "int", min=1),
    Rule("data.num_classes", "int", min=1, nullable=True),
    Rule("model.drop_path_rate", "float", min=0, max=1, nullable=True),
    Rule("optim.weight_decay", "float", min=0),
    Rule("optim.clip_grad", "float", min=0, exclusive_min=True, nullable=True),
    Rule("optim.lr_base_batch", "int", min=1, nullable=True),
    # timm's per-step schedulers (plateau needs a metric at every step, which the trainer does not give)
    Rule("schedule.sched", "str", choices=("cosine", "tanh", "step", "multistep", "poly", "constant", "wsd", "rsqrt")),
    Rule("schedule.warmup_epochs", "float", min=0),
    Rule("schedule.warmup_lr", "float", min=0),
    Rule("schedule.min_lr", "float", min=0),
    Rule("schedule.cooldown_epochs", "float", min=0),
    Rule("save.keep_last", "int", min=0),
    Rule("logger.wandb.mode", "str", choices=("auto", "online", "offline", "disabled")),
    Rule("throughput.batch_size", "int", min=1),
    Rule("throughput.iters", "int", min=1),
    Rule("throughput.warmup", "int", min=0),
)


def _input_size(cfg: DictConfig) -> tuple[int, int]:
    size = cfg.throughput.img_size if cfg.mode == "throughput" and cfg.throughput.img_size else cfg.data.img_size
    return (size, size) if isinstance(size, int) else tuple(size)


def _model_problems(cfg: DictConfig) -> list[str]:
    """Whether the model builds and runs at the configured input size: a forward on the meta device
    (no memory, no compute) catches sizes the patch grid or windows cannot take."""
    hw = _input_size(cfg)
    try:
        with torch.device("meta"):
            build_model(cfg, cfg.data.num_classes or 2).eval()(torch.empty(1, 3, *hw))
    except UserError as error:
        return [str(error)]
    except TypeError as error:  # an argument the model does not take
        return [f"model.kwargs of {cfg.model.name}: {str(error).strip().splitlines()[0]}"]
    except Exception as error:  # the model's own complaint about the input size
        return [
            f"model={cfg.model.name} does not run at {hw[0]}x{hw[1]} (data.img_size): "
            f"{str(error).strip().splitlines()[0]}"
        ]
    return []


# model.kwargs that size the network: each value (or list entry) must be positive.
_SIZE_KWARGS = (
    "depth",
    "depths",
    "embed_dim",
    "embed_dims",
    "num_heads",
    "head_dim",
    "patch_size",
    "mlp_ratio",
    "mlp_ratios",
    "window_size",
    "sr_ratios",
)


def _model_kwargs_problems(cfg: DictConfig) -> list[str]:
    problems = []
    for key, value in (cfg.model.kwargs or {}).items():
        values = list(value) if isinstance(value, ListConfig) else [value]
        if key in _SIZE_KWARGS and not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values
        ):
            problems.append(f"model.kwargs.{key}={value}: sizes the network, must be positive")
    return problems


def _optimizer_problems(cfg: DictConfig) -> list[str]:
    """``optim.opt`` is a timm optimizer and ``optim.kwargs`` are arguments it takes."""
    from timm.optim import get_optimizer_class, list_optimizers

    if cfg.optim.opt not in list_optimizers():
        return [f"optim.opt={cfg.optim.opt!r}: not a timm optimizer (timm.optim.list_optimizers() lists them)"]
    parameters = inspect.signature(get_optimizer_class(cfg.optim.opt, bind_defaults=False)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return []
    accepted = sorted(set(parameters) - {"self", "params", "lr", "weight_decay"})
    unknown = [key for key in cfg.optim.kwargs or {} if key not in parameters]
    return [
        f"optim.kwargs.{key}: not an argument of {cfg.optim.opt} (accepted: {', '.join(accepted)})" for key in unknown
    ]


def _memory_problems(cfg: DictConfig) -> list[str]:
    """Inputs that cannot fit: one batch of input images alone against this machine's memory."""
    hw = _input_size(cfg)
    batch = cfg.throughput.batch_size if cfg.mode == "throughput" else cfg.batch_size
    need = batch * 3 * hw[0] * hw[1] * 4
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need <= have:
        return []
    return [
        f"data.img_size={hw[0]}x{hw[1]} with batch {batch}: one batch of input images alone takes {need / 1e9:.1f} GB "
        f"({batch} x 3 x {hw[0]} x {hw[1]} x 4 bytes), more than this machine's {have / 1e9:.1f} GB of memory"
    ]


def check_config(cfg: DictConfig) -> None:
    """Every problem with a classification config, before data or weights are read (ConfigError)."""
    problems: list[str] = []
    if cfg.device == "cuda" and not torch.cuda.is_available():
        problems.append("device=cuda: CUDA is not available on this machine")
    if cfg.checkpoint is not None and not os.path.isfile(str(cfg.checkpoint)):
        problems.append(f"checkpoint={cfg.checkpoint}: no such file")
    if cfg.data.name in ("imagenet", "folder") and not (
        isinstance(cfg.data.root, str) and os.path.isdir(cfg.data.root)
    ):
        problems.append(
            f"data.root={cfg.data.root}: not a folder (data={cfg.data.name} needs "
            f"{cfg.data.train_split}/<class>/ and {cfg.data.val_split}/<class>/ image folders)"
        )
    try:
        validate_config(cfg, CLS_RULES, problems)
    except ConfigError as error:
        basic = error.problems
    else:
        basic = []
    if not any(p.startswith("optim.") for p in basic):
        basic += _optimizer_problems(cfg)
    sizes = _model_kwargs_problems(cfg)
    if not any(p.startswith(("data.img_size", "throughput.", "batch_size")) for p in basic):
        sizes += _memory_problems(cfg)
    basic += sizes
    if cfg.logger.wandb.mode != "disabled" and (problem := run_id_problem(run_dir_for(cfg.output_dir, cfg.mode))):
        basic.append(problem)
    if not sizes and not any(p.startswith(("data.img_size", "throughput.img_size", "data.num_classes")) for p in basic):
        basic += _model_problems(cfg)
    if basic:
        raise ConfigError(basic)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run ``cfg.mode`` and return what it wrote to ``metrics.json``.

    Training writes into ``output_dir``; eval and throughput into ``output_dir/eval`` and
    ``output_dir/throughput``, so they never overwrite a training run's record.
    """
    use_sweep_cell_dir(cfg)
    check_config(cfg)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    body = {"train": fit, "eval": _eval, "throughput": _throughput}[cfg.mode]
    return run_job(cfg, functools.partial(body, cfg))


def _eval(cfg: DictConfig, env: DistEnv, folder: RunFolder) -> dict[str, Any]:
    checkpoint = cfg.checkpoint or os.path.join(cfg.output_dir, "best.pth")
    if not os.path.isfile(checkpoint):
        raise ConfigError(f"mode=eval needs checkpoint=PATH (no {checkpoint})")
    dataset = build_dataset(cfg.data, cfg.aug, "val")
    model = build_model(cfg, num_classes_of(cfg, dataset), checkpoint=checkpoint).to(env.device)
    folder.write_config(cfg)  # once the weights loaded: the record holds only what ran
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    metrics = evaluate(model, val_loader(cfg, dataset, env), env, cfg.amp.enabled, cfg.amp.dtype, cfg.channels_last)
    folder.log.info(
        "eval %s: top1 %.2f top5 %.2f loss %.4f on %d images",
        checkpoint,
        metrics["top1"],
        metrics["top5"],
        metrics["loss"],
        metrics["num_images"],
    )
    return {**metrics, "checkpoint": os.path.abspath(checkpoint)}


def _throughput(cfg: DictConfig, env: DistEnv, folder: RunFolder) -> dict[str, Any]:
    hw = _input_size(cfg)
    model = build_model(cfg, cfg.data.num_classes or 1000, checkpoint=cfg.checkpoint).to(env.device)
    folder.write_config(cfg)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.compile:
        model = torch.compile(model)
    metrics = measure_throughput(
        model,
        cfg.throughput.batch_size,
        hw,
        env.device,
        cfg.throughput.warmup,
        cfg.throughput.iters,
        cfg.amp.enabled,
        cfg.amp.dtype,
        cfg.channels_last,
    )
    folder.log.info(
        "%s at %dx%d, batch %d: %.1f images/s",
        cfg.model.name,
        *hw,
        cfg.throughput.batch_size,
        metrics["throughput_img_s"],
    )
    return {"model": cfg.model.name, "device": str(env.device), **metrics}
