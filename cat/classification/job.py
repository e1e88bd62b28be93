"""The classification job behind ``train_cls.py``: its config checks, and the train (:func:`fit`),
eval and throughput modes run through cat's one job lifecycle."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from omegaconf import DictConfig
from timm.utils.model import reparameterize_model

from cat.data import SplitDataset, build_dataset
from cat.errors import ConfigError
from cat.models import extract_state_dict, holds_ema_weights, load_checkpoint_file
from cat.paper import paper_top1
from cat.runtime import DistEnv, Precision, RunFolder, describe_precision, run_job, typed_job_config

from .checkpoints import recorded_config
from .checks import check_config
from .data_loading import num_classes_of, val_loader
from .loops import measure_throughput
from .metrics import EVAL_METRICS, console_text, evaluate, split_names
from .model_building import build_model, compile_plan, compiled
from .schema import ClsConfig
from .trainer import fit

__all__ = ["run"]


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run ``cfg.mode`` and return what it wrote to ``metrics.json``.

    Training writes into ``output_dir``; eval and throughput into ``output_dir/eval`` and
    ``output_dir/throughput``, so they never overwrite a training run's record.
    """
    typed, notes = typed_job_config(cfg, ClsConfig)
    typed = check_config(typed)
    if typed.deterministic:
        torch.use_deterministic_algorithms(True)
    body = {"train": fit, "eval": _eval, "throughput": _throughput}[typed.mode]
    return run_job(typed, functools.partial(body, typed), notes)


def _eval(cfg: ClsConfig, env: DistEnv, folder: RunFolder) -> dict[str, Any]:
    checkpoint = cfg.checkpoint or os.path.join(cfg.output_dir, "best.pth")
    if not os.path.isfile(checkpoint):
        raise ConfigError(f"mode=eval needs checkpoint=PATH (no {checkpoint})")
    # The weights before the data where the config gives the class count, as training does: a file that does not
    # fit or is refused is named before the val folders are scanned.
    dataset = None if cfg.data.num_classes is not None else _val_set(cfg, env)
    num_classes = num_classes_of(cfg, dataset)
    precision = Precision.from_config(cfg.amp, env.device, cfg.channels_last)
    entries = load_checkpoint_file(checkpoint)
    # The model's weights, and the weight EMA where the run kept one: both are the run's result.
    weights = {"": extract_state_dict(entries, checkpoint)}
    if holds_ema_weights(entries):
        weights["ema_"] = extract_state_dict(entries, checkpoint, use_ema=True)
    trained_config = recorded_config(entries)
    del entries  # the optimizer's state, among others
    models = {
        prefix: _for_inference(
            precision,
            build_model(
                cfg.model,
                num_classes,
                cfg.input_size()[0],
                checkpoint,
                cfg.strict_load,
                state_dict=state_dict,
                trained_config=trained_config,
            ),
        )
        for prefix, state_dict in weights.items()
    }
    folder.write_config(cfg)  # once the weights loaded: the record holds only what ran
    folder.log.info("%s", describe_precision(cfg.amp, env.device))
    plan = compile_plan(cfg, env.device)
    folder.log.info("%s", plan.line())
    loader = val_loader(cfg, _val_set(cfg, env) if dataset is None else dataset, env)
    metrics: dict[str, Any] = {}
    for prefix, model in models.items():
        result = evaluate(compiled(plan, model), loader, env, precision)
        folder.log.info(
            "eval %s%s: %s on %d images",
            checkpoint,
            ", its weight EMA" if prefix else "",
            console_text(result),
            result["num_images"],
        )
        if (line := beside_the_paper(cfg, num_classes, result["top1"])) is not None:
            folder.log.info("%s", line)
        metrics.update({f"{prefix}{metric.name}": result[metric.name] for metric in EVAL_METRICS})
        metrics.setdefault("num_images", result["num_images"])
    # One name per metric (cat.classification.metrics): eval/<name> in metrics.json, metrics.jsonl and W&B.
    record = split_names("eval", metrics)
    folder.metrics.log({k: v for k, v in record.items() if k != "eval/num_images"}, step=0)
    return {**record, "checkpoint": os.path.abspath(checkpoint)}


def beside_the_paper(cfg: ClsConfig, num_classes: int, top1: float) -> str | None:
    """The eval log's line putting Table 2's ImageNet-1K top-1 beside ``top1``, where the model an eval of ``cfg``
    runs is one the table prints: its registered configuration (no ``model.kwargs``, not converted), 1000 classes,
    at a size the table gives. None otherwise: a Table 5 ablation (``kwargs: {reweight: none}``) or a narrower model
    under the same name is not the model the paper measured."""
    if num_classes != 1000 or cfg.model.kwargs or cfg.model.convert is not None:
        return None
    size = cfg.input_size()[0]
    if (reference := paper_top1(cfg.model.name, size)) is None:
        return None
    label, paper = reference
    return f"the paper's ImageNet-1K top-1 for {label} at {size}²: {paper:.1f}% (Table 2); this eval: {top1:.2f}%"


def _for_inference(precision: Precision, model: torch.nn.Module) -> torch.nn.Module:
    """A model whose weights are loaded, reparameterized for inference (timm's: circulant blocks make their
    weight-only work once) and put in ``precision``'s device, dtype and layout."""
    return precision.model(reparameterize_model(model, inplace=True))


def _val_set(cfg: ClsConfig, env: DistEnv) -> SplitDataset:
    return build_dataset(cfg.data, cfg.aug, "val", env.rank, env.world_size)


def _throughput(cfg: ClsConfig, env: DistEnv, folder: RunFolder) -> dict[str, Any]:
    hw = cfg.input_size()
    precision = Precision.from_config(cfg.amp, env.device, cfg.channels_last)
    model = _for_inference(
        precision,
        build_model(
            cfg.model,
            cfg.data.num_classes or 1000,
            hw[0],
            checkpoint=cfg.checkpoint,
            strict=cfg.strict_load,
            use_ema=cfg.checkpoint_ema,
        ),
    )
    folder.write_config(cfg)
    folder.log.info("%s", describe_precision(cfg.amp, env.device))
    plan = compile_plan(cfg, env.device)
    folder.log.info("%s", plan.line())
    model = compiled(plan, model)
    metrics = measure_throughput(
        model, cfg.throughput.batch_size, hw, precision, cfg.throughput.warmup, cfg.throughput.iters
    )
    folder.log.info(
        "%s at %dx%d, batch %d: %.1f images/s",
        cfg.model.name,
        *hw,
        cfg.throughput.batch_size,
        metrics["throughput_img_s"],
    )
    folder.metrics.log({f"throughput/{k}": metrics[k] for k in ("throughput_img_s", "ms_per_batch")}, step=0)
    return {"model": cfg.model.name, "device": str(env.device), **metrics}
