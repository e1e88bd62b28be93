"""The classification job behind ``train_cls.py``: train (resumable), eval and throughput modes."""
from __future__ import annotations

import itertools
import os
import signal
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

import cat
from cat.data import build_dataset

from .checkpoint import CheckpointManager, atomic_write_json, capture_rng_state, restore_rng_state, seed_everything
from .dist import DistEnv, init_distributed
from .launch import prepare_output_dir
from .logger import WandbLogger
from .train import TrainOptions, evaluate, measure_throughput, train_one_epoch

__all__ = ["run", "build_model"]


class ResumableSampler(Sampler[int]):
    """A DistributedSampler whose epoch can start part-way (after ``skip`` samples of this rank)."""

    def __init__(self, base: DistributedSampler) -> None:
        self.base = base
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.base.set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.base), self.skip, None)

    def __len__(self) -> int:
        return len(self.base) - self.skip


class ShardSampler(Sampler[int]):
    """Every ``world``-th index from ``rank``: each sample evaluated exactly once across ranks."""

    def __init__(self, size: int, rank: int, world: int) -> None:
        self.indices = range(rank, size, world)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _epoch_seed(seed: int, epoch: int, rank: int) -> int:
    # Re-seeding at each epoch start makes an epoch's randomness independent of how the run got there,
    # so a run resumed from an epoch-end checkpoint matches an uninterrupted one.
    return seed * 1_000_003 + epoch * 1009 + rank


def build_model(cfg: DictConfig, num_classes: int, checkpoint: str | None = None, strict: bool = True) -> nn.Module:
    kwargs = dict(OmegaConf.to_container(cfg.model.kwargs, resolve=True))
    kwargs.setdefault("img_size", cfg.data.img_size)
    return cat.create_model(cfg.model.name, checkpoint=checkpoint, strict=strict, num_classes=num_classes,
                            drop_path_rate=cfg.model.drop_path_rate, **kwargs)


def _num_classes(cfg: DictConfig, dataset: Dataset) -> int:
    if cfg.data.num_classes is not None:
        return int(cfg.data.num_classes)
    return len(dataset.classes)  # folder datasets: one class per folder


def _val_loader(cfg: DictConfig, dataset: Dataset, env: DistEnv) -> DataLoader:
    return DataLoader(dataset, batch_size=cfg.batch_size, sampler=ShardSampler(len(dataset), env.rank, env.world_size),
                      num_workers=cfg.workers, pin_memory=cfg.pin_memory and env.device.type == "cuda")


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run ``cfg.mode`` and return what it wrote to ``output_dir/metrics.json``."""
    if cfg.mode not in ("train", "eval", "throughput"):
        raise ValueError(f"mode must be train, eval or throughput; got {cfg.mode!r}")
    env = init_distributed(cfg.device)
    output_dir, log = prepare_output_dir(cfg, env)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    seed_everything(cfg.seed + env.rank)
    log.info("%s mode on %s (world size %d), output in %s", cfg.mode, env.device, env.world_size, output_dir)
    try:
        if cfg.mode == "train":
            metrics = _train(cfg, env, output_dir, log)
        elif cfg.mode == "eval":
            metrics = _eval(cfg, env, output_dir, log)
        else:
            metrics = _throughput(cfg, env, log)
        if env.is_main:
            atomic_write_json(os.path.join(output_dir, "metrics.json"), metrics)
        return metrics
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _eval(cfg: DictConfig, env: DistEnv, output_dir: str, log) -> dict[str, Any]:
    checkpoint = cfg.checkpoint or os.path.join(output_dir, "best.pth")
    if not os.path.isfile(checkpoint):
        raise FileNotFoundError(f"mode=eval needs checkpoint=PATH (no {checkpoint})")
    dataset = build_dataset(cfg.data, cfg.aug, "val")
    model = build_model(cfg, _num_classes(cfg, dataset), checkpoint=checkpoint).to(env.device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    metrics = evaluate(model, _val_loader(cfg, dataset, env), env, cfg.amp.enabled, cfg.amp.dtype, cfg.channels_last)
    log.info("eval %s: top1 %.2f top5 %.2f loss %.4f on %d images", checkpoint, metrics["top1"], metrics["top5"],
             metrics["loss"], metrics["num_images"])
    return {**metrics, "checkpoint": os.path.abspath(checkpoint)}


def _throughput(cfg: DictConfig, env: DistEnv, log) -> dict[str, Any]:
    size = cfg.throughput.img_size or cfg.data.img_size
    hw = (size, size) if isinstance(size, int) else tuple(size)
    model = build_model(cfg, cfg.data.num_classes or 1000, checkpoint=cfg.checkpoint).to(env.device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.compile:
        model = torch.compile(model)
    metrics = measure_throughput(model, cfg.throughput.batch_size, hw, env.device, cfg.throughput.warmup,
                                 cfg.throughput.iters, cfg.amp.enabled, cfg.amp.dtype, cfg.channels_last)
    log.info("%s at %dx%d, batch %d: %.1f images/s", cfg.model.name, *hw, cfg.throughput.batch_size,
             metrics["throughput_img_s"])
    return {"model": cfg.model.name, "device": str(env.device), **metrics}


def _train(cfg: DictConfig, env: DistEnv, output_dir: str, log) -> dict[str, Any]:
    train_set = build_dataset(cfg.data, cfg.aug, "train")
    val_set = build_dataset(cfg.data, cfg.aug, "val")
    num_classes = _num_classes(cfg, train_set)
    global_batch = cfg.batch_size * env.world_size
    mixup_active = cfg.aug.mixup > 0 or cfg.aug.cutmix > 0
    if mixup_active and cfg.batch_size % 2:
        raise ValueError(f"batch_size={cfg.batch_size} must be even when mixup/cutmix is on (they pair samples)")
    if len(train_set) < global_batch:
        raise ValueError(f"the train split has {len(train_set)} images, fewer than one global batch of "
                         f"{global_batch} (batch_size={cfg.batch_size} x {env.world_size} processes)")

    sampler = ResumableSampler(DistributedSampler(train_set, num_replicas=env.world_size, rank=env.rank,
                                                  shuffle=True, seed=cfg.seed, drop_last=True))
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                              num_workers=cfg.workers, pin_memory=cfg.pin_memory and env.device.type == "cuda",
                              persistent_workers=cfg.workers > 0)
    val_loader = _val_loader(cfg, val_set, env)
    steps_per_epoch = len(sampler.base) // cfg.batch_size

    model = build_model(cfg, num_classes, checkpoint=cfg.checkpoint, strict=cfg.strict_load).to(env.device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ema = ModelEmaV3(model, decay=cfg.ema.decay) if cfg.ema.enabled else None
    lr = cfg.lr * global_batch / cfg.optim.lr_base_batch if cfg.optim.lr_base_batch else cfg.lr
    optimizer = create_optimizer_v2(model, opt=cfg.optim.opt, lr=lr, weight_decay=cfg.optim.weight_decay,
                                    momentum=cfg.optim.momentum, **OmegaConf.to_container(cfg.optim.kwargs))
    scheduler, _ = create_scheduler_v2(optimizer, sched=cfg.schedule.sched, num_epochs=cfg.epochs,
                                       warmup_epochs=cfg.schedule.warmup_epochs, warmup_lr=cfg.schedule.warmup_lr,
                                       min_lr=cfg.schedule.min_lr, cooldown_epochs=cfg.schedule.cooldown_epochs,
                                       step_on_epochs=False, updates_per_epoch=steps_per_epoch)
    fp16_scaling = cfg.amp.enabled and cfg.amp.dtype == "fp16" and env.device.type == "cuda"
    scaler = torch.amp.GradScaler(env.device.type, enabled=fp16_scaling)
    mixup_fn = Mixup(mixup_alpha=cfg.aug.mixup, cutmix_alpha=cfg.aug.cutmix, prob=cfg.aug.mixup_prob,
                     switch_prob=cfg.aug.mixup_switch_prob, mode=cfg.aug.mixup_mode,
                     label_smoothing=cfg.aug.smoothing, num_classes=num_classes) if mixup_active else None
    if mixup_active:
        criterion: nn.Module = SoftTargetCrossEntropy()
    elif cfg.aug.smoothing > 0:
        criterion = LabelSmoothingCrossEntropy(cfg.aug.smoothing)
    else:
        criterion = nn.CrossEntropyLoss()

    ckpt = CheckpointManager(output_dir, keep_last=cfg.save.keep_last)
    state = ckpt.load_last() if cfg.resume else None
    start_epoch, skip_steps, best_top1, wall_time, last_metrics, resume_rng = 0, 0, float("-inf"), 0.0, {}, None
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        if ema is not None and state.get("ema") is not None:
            ema.load_state_dict(state["ema"])
        start_epoch, skip_steps = state["epoch"] + 1, state["step_in_epoch"]
        best_top1, wall_time, last_metrics = state["best_top1"], state["wall_time_s"], state["metrics"]
        rng = state.get("rng")
        if skip_steps and rng is not None and len(rng) == env.world_size:
            resume_rng = rng[env.rank]
        log.info("resumed from %s: epoch %d, step %d", ckpt.last, start_epoch, skip_steps)

    train_model: nn.Module = torch.compile(model) if cfg.compile else model
    if env.distributed:
        train_model = DistributedDataParallel(train_model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
    resolved_config = OmegaConf.to_container(cfg, resolve=True)
    wandb = WandbLogger(cfg.logger.wandb, output_dir, resolved_config, enabled=env.is_main)

    stop = {"requested": False}

    def request_stop(signum, frame):  # Slurm preemption: finish the step, save, exit cleanly
        stop["requested"] = True

    previous_handler = signal.signal(signal.SIGTERM, request_stop)
    opts = TrainOptions(clip_grad=cfg.optim.clip_grad, amp=cfg.amp.enabled, amp_dtype=cfg.amp.dtype,
                        channels_last=cfg.channels_last, log_interval=cfg.log_interval)

    def checkpoint_state(epoch: int, step_in_epoch: int, rng: list | None) -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(), "ema": ema.state_dict() if ema is not None else None,
                "epoch": epoch, "step_in_epoch": step_in_epoch, "best_top1": best_top1, "metrics": last_metrics,
                "wall_time_s": wall_time, "config": resolved_config, "rng": rng}

    log.info("model %s: %.2fM params; %d train / %d val images, %d classes; global batch %d, lr %.2e, "
             "%d steps/epoch", cfg.model.name, sum(p.numel() for p in model.parameters()) / 1e6, len(train_set),
             len(val_set), num_classes, global_batch, lr, steps_per_epoch)
    try:
        for epoch in range(start_epoch, cfg.epochs):
            t0 = time.perf_counter()
            seed_everything(_epoch_seed(cfg.seed, epoch, env.rank))
            skip = skip_steps if epoch == start_epoch else 0
            sampler.set_epoch(epoch, skip * cfg.batch_size)
            batches = iter(train_loader)
            if skip and resume_rng is not None:
                restore_rng_state(resume_rng)  # after creating the iterator, which draws from the RNG
            result = train_one_epoch(train_model, batches, criterion, optimizer, scheduler, scaler, env, epoch,
                                     first_update=epoch * steps_per_epoch + skip, opts=opts, mixup_fn=mixup_fn,
                                     ema=ema, stop_requested=lambda: stop["requested"], log_fn=wandb.log,
                                     total_steps=steps_per_epoch - skip)
            if result.interrupted:
                wall_time += time.perf_counter() - t0
                rng: list | None = [None] * env.world_size
                if env.distributed:
                    dist.all_gather_object(rng, capture_rng_state())
                else:
                    rng = [capture_rng_state()]
                if env.is_main:
                    ckpt.save(checkpoint_state(epoch - 1, skip + result.steps, rng), epoch_end=False)
                log.info("stop requested (SIGTERM): saved epoch %d step %d to %s; rerun the same command to resume",
                         epoch, skip + result.steps, ckpt.last)
                return {**last_metrics, "best_top1": best_top1, "epoch": epoch, "wall_time_s": wall_time,
                        "preempted": True}
            scheduler.step(epoch + 1)
            eval_metrics = evaluate(train_model, val_loader, env, cfg.amp.enabled, cfg.amp.dtype, cfg.channels_last)
            if ema is not None:
                ema_metrics = evaluate(ema.module, val_loader, env, cfg.amp.enabled, cfg.amp.dtype, cfg.channels_last)
                eval_metrics["ema_top1"] = ema_metrics["top1"]
            is_best = eval_metrics["top1"] > best_top1
            best_top1 = max(best_top1, eval_metrics["top1"])
            wall_time += time.perf_counter() - t0
            last_metrics = {"top1": eval_metrics["top1"], "top5": eval_metrics["top5"], "val_loss": eval_metrics["loss"],
                            "train_loss": result.loss}
            if env.is_main:
                ckpt.save(checkpoint_state(epoch, 0, None), is_best=is_best)
            log.info("epoch %d/%d  train loss %.4f  lr %.2e  val top1 %.2f top5 %.2f loss %.4f  best %.2f  "
                     "(%.1f s, %.0f img/s)", epoch + 1, cfg.epochs, result.loss, result.lr, eval_metrics["top1"],
                     eval_metrics["top5"], eval_metrics["loss"], best_top1, time.perf_counter() - t0,
                     result.images_per_s)
            wandb.log({"epoch": epoch + 1, "train/loss": result.loss, "train/lr": result.lr,
                       "train/images_per_s": result.images_per_s, "val/top1": eval_metrics["top1"],
                       "val/top5": eval_metrics["top5"], "val/loss": eval_metrics["loss"], "val/best_top1": best_top1,
                       **({"val/ema_top1": eval_metrics["ema_top1"]} if ema is not None else {})},
                      step=(epoch + 1) * steps_per_epoch)
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        wandb.finish()
    if start_epoch >= cfg.epochs:
        log.info("%s already holds a finished run of %d epochs", output_dir, cfg.epochs)
    return {**last_metrics, "best_top1": best_top1, "epoch": cfg.epochs, "wall_time_s": wall_time}
