"""How a classification run trains: its train state (optimizer, schedule, EMA, scaler), mixup and the loop's
options (loss, steps, logging)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3
from torch import nn

from cat.data import AugConfig
from cat.data.images import build_batch_transform
from cat.runtime import DistEnv, Precision
from cat.runtime.meter import StepMeter
from cat.runtime.profiling import ProfileWindow

from .data_loading import TrainData
from .loops import TrainOptions
from .model_building import build_train_model
from .schema import ClsConfig
from .state import TrainState

__all__ = ["build_train_state", "build_mixup", "build_train_options", "FUSED_OPTIMIZERS", "step_kwargs"]

# timm's names for torch's optimizers with a fused CUDA step (one kernel per step for all parameters).
FUSED_OPTIMIZERS = ("adamw", "adam")


def step_kwargs(opt: str, device: torch.device, kwargs: dict[str, Any]) -> dict[str, Any]:
    """What the optimizer is told about its step beyond ``optim.kwargs``: ``fused=True`` for torch's Adam and AdamW
    on CUDA (all parameters' updates in one kernel instead of several per parameter); else nothing, which leaves
    torch's own choice (its foreach step on CUDA). An ``optim.kwargs`` that names ``fused`` or ``foreach`` wins."""
    if device.type != "cuda" or "fused" in kwargs or "foreach" in kwargs:
        return {}
    return {"fused": True} if opt.lower() in FUSED_OPTIMIZERS else {}


def build_train_state(cfg: ClsConfig, env: DistEnv, data: TrainData, model: nn.Module | None = None) -> TrainState:
    """A fresh train state: the ``model`` (:func:`build_train_model` if not given), EMA, AdamW-style optimizer
    with the linearly scaled lr, the per-step schedule and the fp16 scaler (CUDA only)."""
    precision = Precision.from_config(cfg.amp, env.device, cfg.channels_last)
    if model is None:
        model = build_train_model(cfg, env, data.num_classes)
    ema = ModelEmaV3(model, decay=cfg.ema.decay) if cfg.ema.enabled else None
    lr = cfg.lr * data.global_batch / cfg.optim.lr_base_batch if cfg.optim.lr_base_batch else cfg.lr
    optimizer = create_optimizer_v2(
        model,
        opt=cfg.optim.opt,
        lr=lr,
        weight_decay=cfg.optim.weight_decay,
        momentum=cfg.optim.momentum,
        **cfg.optim.kwargs,
        **step_kwargs(cfg.optim.opt, env.device, cfg.optim.kwargs),
    )
    # The schedule is a pure function of the step, built from the current config (never restored).
    scheduler, _ = create_scheduler_v2(
        optimizer,
        sched=cfg.schedule.sched,
        num_epochs=cfg.epochs,
        warmup_epochs=cfg.schedule.warmup_epochs,  # type: ignore[arg-type]  # a fraction works; timm says int
        warmup_lr=cfg.schedule.warmup_lr,
        min_lr=cfg.schedule.min_lr,
        cooldown_epochs=cfg.schedule.cooldown_epochs,  # type: ignore[arg-type]  # as warmup_epochs
        step_on_epochs=False,
        updates_per_epoch=data.steps_per_epoch,
    )
    return TrainState(model, optimizer, scheduler, precision.grad_scaler(), ema)


def build_mixup(aug: AugConfig, num_classes: int) -> Mixup | None:
    """timm's batch mixup/cutmix (with label smoothing) of the ``aug`` recipe; None when both are off."""
    if not (aug.mixup > 0 or aug.cutmix > 0):
        return None
    return Mixup(
        mixup_alpha=aug.mixup,
        cutmix_alpha=aug.cutmix,
        prob=aug.mixup_prob,
        switch_prob=aug.mixup_switch_prob,
        mode=aug.mixup_mode,
        label_smoothing=aug.smoothing,
        num_classes=num_classes,
    )


def build_train_options(
    cfg: ClsConfig,
    env: DistEnv,
    data: TrainData,
    log_fn: Callable[[dict[str, float | None], int], None] | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
    meter: StepMeter | None = None,
    profiler: ProfileWindow | None = None,
) -> TrainOptions:
    """The loss (soft targets under mixup/cutmix, else label smoothing or plain cross-entropy) and
    everything else an epoch needs to know: where step metrics go, what measures the steps, and how a
    stop is asked for."""
    mixup_fn = build_mixup(cfg.aug, data.num_classes)
    if mixup_fn is not None:
        criterion: nn.Module = SoftTargetCrossEntropy()
    elif cfg.aug.smoothing > 0:
        criterion = LabelSmoothingCrossEntropy(cfg.aug.smoothing)
    else:
        criterion = nn.CrossEntropyLoss()
    return TrainOptions(
        criterion=criterion,
        precision=Precision.from_config(cfg.amp, env.device, cfg.channels_last),
        steps_per_epoch=data.steps_per_epoch,
        accum_steps=data.accum_steps,
        num_epochs=cfg.epochs,
        mixup_fn=mixup_fn,
        clip_grad=cfg.optim.clip_grad,
        log_interval=cfg.log_interval,
        stop_requested=stop_requested,
        log_fn=log_fn,
        batch_transform=build_batch_transform(cfg.data, cfg.aug, env.device),
        meter=meter,
        profiler=profiler,
    )
