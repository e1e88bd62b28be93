"""The classification job behind ``train_cls.py``: train (resumable), eval and throughput modes."""
from __future__ import annotations

import itertools
import json
import math
import os
import signal
import time
from dataclasses import asdict
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
from cat.errors import ConfigError, UserError
from cat.runtime import (RunFolder, Rule, atomic_write_json, init_distributed, open_run_folder, run_dir_for,
                         validate_config)
from cat.runtime.dist import DistEnv
from cat.runtime.logger import WandbLogger

from .checkpoint import CheckpointManager, capture_rng_state, restore_rng_state, seed_everything
from .train import EpochProgress, NonFiniteLossError, TrainOptions, evaluate, measure_throughput, train_one_epoch

__all__ = ["run", "build_model", "CLS_RULES", "check_config", "RESUME_FIXED_KEYS"]

CLS_RULES = (
    Rule("mode", "str", choices=("train", "eval", "throughput")),
    Rule("epochs", "int", min=1), Rule("batch_size", "int", min=1), Rule("lr", "float", min=0, exclusive_min=True),
    Rule("seed", "int", min=0), Rule("workers", "int", min=0), Rule("log_interval", "int", min=1),
    Rule("device", "str", choices=("auto", "cpu", "cuda")), Rule("checkpoint", "str", nullable=True),
    *(Rule(key, "bool") for key in ("resume", "strict_load", "compile", "channels_last", "deterministic",
                                    "pin_memory", "debug", "amp.enabled", "ema.enabled")),
    Rule("amp.dtype", "str", choices=("bf16", "fp16")), Rule("ema.decay", "float", min=0, max=1),
    Rule("data.name", "str", choices=("imagenet", "folder", "digits", "synthetic")),
    Rule("data.img_size", "int", min=1), Rule("data.num_classes", "int", min=1, nullable=True),
    Rule("optim.weight_decay", "float", min=0), Rule("optim.clip_grad", "float", min=0, exclusive_min=True, nullable=True),
    Rule("optim.lr_base_batch", "int", min=1, nullable=True),
    Rule("schedule.warmup_epochs", "float", min=0), Rule("schedule.warmup_lr", "float", min=0),
    Rule("schedule.min_lr", "float", min=0), Rule("schedule.cooldown_epochs", "float", min=0),
    Rule("save.keep_last", "int", min=0),
    Rule("logger.wandb.mode", "str", choices=("auto", "online", "offline", "disabled")),
    Rule("throughput.batch_size", "int", min=1), Rule("throughput.iters", "int", min=1),
    Rule("throughput.warmup", "int", min=0),
)

# A resumed run may change anything else (epochs, lr, schedule, optimizer settings: applied from the
# resumed step on); these would make it a different run, so resuming with them changed is refused.
RESUME_FIXED_KEYS = ("model.", "data.", "aug.", "batch_size", "seed", "optim.opt", "ema.enabled")
RESUME_FREE_KEYS = ("data.root",)  # the same data may move



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
    except Exception as error:  # the model's own complaint about the input size
        return [f"model={cfg.model.name} does not run at {hw[0]}x{hw[1]} (data.img_size): "
                f"{str(error).strip().splitlines()[0]}"]
    return []


def check_config(cfg: DictConfig) -> None:
    """Every problem with a classification config, before data or weights are read (ConfigError)."""
    problems: list[str] = []
    if cfg.device == "cuda" and not torch.cuda.is_available():
        problems.append("device=cuda: CUDA is not available on this machine")
    if cfg.checkpoint is not None and not os.path.isfile(str(cfg.checkpoint)):
        problems.append(f"checkpoint={cfg.checkpoint}: no such file")
    if cfg.data.name in ("imagenet", "folder") and not (isinstance(cfg.data.root, str) and os.path.isdir(cfg.data.root)):
        problems.append(f"data.root={cfg.data.root}: not a folder (data={cfg.data.name} needs "
                        f"{cfg.data.train_split}/<class>/ and {cfg.data.val_split}/<class>/ image folders)")
    try:
        validate_config(cfg, CLS_RULES, problems)
    except ConfigError as error:
        basic = error.problems
    else:
        basic = []
    if not any(p.startswith(("data.img_size", "throughput.img_size", "data.num_classes")) for p in basic):
        basic += _model_problems(cfg)
    if basic:
        raise ConfigError(basic)


def _num_classes(cfg: DictConfig, dataset: Dataset) -> int:
    if cfg.data.num_classes is not None:
        return int(cfg.data.num_classes)
    return len(dataset.classes)  # folder datasets: one class per folder


def _val_loader(cfg: DictConfig, dataset: Dataset, env: DistEnv) -> DataLoader:
    return DataLoader(dataset, batch_size=cfg.batch_size, sampler=ShardSampler(len(dataset), env.rank, env.world_size),
                      num_workers=cfg.workers, pin_memory=cfg.pin_memory and env.device.type == "cuda")


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run ``cfg.mode`` and return what it wrote to ``metrics.json``.

    Training writes into ``output_dir``; eval and throughput into ``output_dir/eval`` and
    ``output_dir/throughput``, so they never overwrite a training run's record.
    """
    check_config(cfg)
    env = init_distributed(cfg.device)
    folder = open_run_folder(run_dir_for(cfg.output_dir, cfg.mode), env)
    try:
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True)
        seed_everything(cfg.seed + env.rank)
        folder.log.info("%s mode on %s (world size %d), output in %s", cfg.mode, env.device, env.world_size,
                        folder.path)
        if cfg.mode == "train":
            metrics = _train(cfg, env, folder)
        else:
            folder.write_config(cfg)
            metrics = _eval(cfg, env, folder) if cfg.mode == "eval" else _throughput(cfg, env, folder)
        if env.is_main:
            atomic_write_json(folder.file("metrics.json"), metrics)
        return metrics
    finally:
        folder.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _eval(cfg: DictConfig, env: DistEnv, folder: RunFolder) -> dict[str, Any]:
    checkpoint = cfg.checkpoint or os.path.join(cfg.output_dir, "best.pth")
    if not os.path.isfile(checkpoint):
        raise ConfigError(f"mode=eval needs checkpoint=PATH (no {checkpoint})")
    dataset = build_dataset(cfg.data, cfg.aug, "val")
    model = build_model(cfg, _num_classes(cfg, dataset), checkpoint=checkpoint).to(env.device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    metrics = evaluate(model, _val_loader(cfg, dataset, env), env, cfg.amp.enabled, cfg.amp.dtype, cfg.channels_last)
    folder.log.info("eval %s: top1 %.2f top5 %.2f loss %.4f on %d images", checkpoint, metrics["top1"], metrics["top5"],
             metrics["loss"], metrics["num_images"])
    return {**metrics, "checkpoint": os.path.abspath(checkpoint)}


def _throughput(cfg: DictConfig, env: DistEnv, folder: RunFolder) -> dict[str, Any]:
    hw = _input_size(cfg)
    model = build_model(cfg, cfg.data.num_classes or 1000, checkpoint=cfg.checkpoint).to(env.device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.compile:
        model = torch.compile(model)
    metrics = measure_throughput(model, cfg.throughput.batch_size, hw, env.device, cfg.throughput.warmup,
                                 cfg.throughput.iters, cfg.amp.enabled, cfg.amp.dtype, cfg.channels_last)
    folder.log.info("%s at %dx%d, batch %d: %.1f images/s", cfg.model.name, *hw, cfg.throughput.batch_size,
             metrics["throughput_img_s"])
    return {"model": cfg.model.name, "device": str(env.device), **metrics}


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def resume_changes(saved: dict[str, Any], current: dict[str, Any]) -> tuple[dict[str, list], list[str]]:
    """Config keys that differ from the checkpoint's (``{key: [saved, current]}``), and those of
    them a resume cannot take (:data:`RESUME_FIXED_KEYS`)."""
    old, new = _flatten(saved), _flatten(current)
    changed = {k: [old.get(k), new.get(k)] for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)}
    fixed = [k for k in changed if k.startswith(RESUME_FIXED_KEYS) and k not in RESUME_FREE_KEYS]
    return changed, fixed


def _weights_finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in model.state_dict().values() if t.is_floating_point())


def _train(cfg: DictConfig, env: DistEnv, folder: RunFolder) -> dict[str, Any]:
    log = folder.log
    train_set = build_dataset(cfg.data, cfg.aug, "train")
    val_set = build_dataset(cfg.data, cfg.aug, "val")
    num_classes = _num_classes(cfg, train_set)
    global_batch = cfg.batch_size * env.world_size
    mixup_active = cfg.aug.mixup > 0 or cfg.aug.cutmix > 0
    if mixup_active and cfg.batch_size % 2:
        raise ConfigError(f"batch_size={cfg.batch_size} must be even when mixup/cutmix is on (they pair samples)")
    if len(train_set) < global_batch:
        raise ConfigError(f"the train split has {len(train_set)} images, fewer than one global batch of "
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
    # The schedule is a pure function of the step, built from the current config (never restored).
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

    resolved_config = OmegaConf.to_container(cfg, resolve=True)
    ckpt = CheckpointManager(folder.path, keep_last=cfg.save.keep_last)
    state = ckpt.load_last() if cfg.resume else None
    start_epoch, skip_steps, best_top1, wall_time, last_metrics = 0, 0, None, 0.0, {}
    resume_rng, carried = None, None
    if state is not None:
        start_epoch, skip_steps = state["epoch"] + 1, state["step_in_epoch"]
        changed, fixed = resume_changes(state.get("config") or {}, resolved_config)
        if skip_steps and state.get("world_size", env.world_size) != env.world_size:
            fixed.append(f"world size {state['world_size']} -> {env.world_size} (mid-epoch)")
        if fixed:
            raise ConfigError([f"cannot resume {ckpt.last} with a different {k}" +
                               (f": {changed[k][0]!r} -> {changed[k][1]!r}" if k in changed else "") for k in fixed]
                              + ["start a new run in another output_dir, or pass resume=false to overwrite"])
        model.load_state_dict(state["model"])
        hyperparameters = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        optimizer.load_state_dict(state["optimizer"])
        for group, current in zip(optimizer.param_groups, hyperparameters):
            group.update(current)  # keep moments and step counts, take lr/decay/betas from the config
        scaler.load_state_dict(state["scaler"])
        if ema is not None and state.get("ema") is not None:
            ema.load_state_dict(state["ema"])
        best_top1, wall_time, last_metrics = state["best_top1"], state["wall_time_s"], state["metrics"]
        rng, progress = state.get("rng"), state.get("epoch_progress")
        if skip_steps and rng is not None and len(rng) == env.world_size:
            resume_rng = rng[env.rank]
        if skip_steps and progress is not None and len(progress) == env.world_size:
            carried = EpochProgress(**progress[env.rank])
        log.info("resumed from %s: epoch %d, step %d of %d", ckpt.last, start_epoch + 1, skip_steps, steps_per_epoch)
        if changed:
            log.info("config changed since the checkpoint, applied from here on: %s",
                     "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items()))
            if env.is_main:
                with open(folder.file("config_changes.jsonl"), "a") as f:
                    f.write(json.dumps({"epoch": start_epoch + 1, "step_in_epoch": skip_steps, "changed": changed,
                                        "time": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    scheduler.step_update(num_updates=start_epoch * steps_per_epoch + skip_steps)
    folder.write_config(cfg)

    train_model: nn.Module = torch.compile(model) if cfg.compile else model
    if env.distributed:
        train_model = DistributedDataParallel(train_model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
    wandb = WandbLogger(cfg.logger.wandb, folder.path, resolved_config, enabled=env.is_main)

    stop = {"requested": False}

    def request_stop(signum, frame):  # Slurm preemption: finish the step, save, exit cleanly
        stop["requested"] = True

    previous_handler = signal.signal(signal.SIGTERM, request_stop)
    opts = TrainOptions(clip_grad=cfg.optim.clip_grad, amp=cfg.amp.enabled, amp_dtype=cfg.amp.dtype,
                        channels_last=cfg.channels_last, log_interval=cfg.log_interval, num_epochs=cfg.epochs)

    def checkpoint_state(epoch: int, step_in_epoch: int, rng: list | None, progress: list | None) -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(), "ema": ema.state_dict() if ema is not None else None,
                "epoch": epoch, "step_in_epoch": step_in_epoch, "best_top1": best_top1, "metrics": last_metrics,
                "wall_time_s": wall_time, "config": resolved_config, "rng": rng, "epoch_progress": progress,
                "world_size": env.world_size}

    def kept() -> str:
        return f"{ckpt.last} (the last good checkpoint) is kept" if os.path.isfile(ckpt.last) else "nothing was saved"

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
                                     steps_per_epoch=steps_per_epoch, first_step=skip,
                                     carried=carried if epoch == start_epoch else None)
            if result.interrupted and skip + result.steps < steps_per_epoch:
                wall_time += time.perf_counter() - t0
                if not _weights_finite(model):
                    raise NonFiniteLossError(f"epoch {epoch + 1}: weights are not finite at the stop; {kept()}")
                rng: list | None = [None] * env.world_size
                progress: list | None = [None] * env.world_size
                if env.distributed:
                    dist.all_gather_object(rng, capture_rng_state())
                    dist.all_gather_object(progress, asdict(result.progress))
                else:
                    rng, progress = [capture_rng_state()], [asdict(result.progress)]
                if env.is_main:
                    ckpt.save(checkpoint_state(epoch - 1, skip + result.steps, rng, progress), epoch_end=False)
                log.info("stop requested (SIGTERM): saved epoch %d step %d/%d to %s; rerun the same command to resume",
                         epoch + 1, skip + result.steps, steps_per_epoch, ckpt.last)
                return {**last_metrics, "best_top1": best_top1, "epoch": epoch, "wall_time_s": wall_time,
                        "preempted": True}
            # A stop on the epoch's last step lets the epoch end normally (evaluated and saved) first.
            eval_metrics = evaluate(train_model, val_loader, env, cfg.amp.enabled, cfg.amp.dtype, cfg.channels_last)
            if not math.isfinite(eval_metrics["loss"]) or not _weights_finite(model):
                what = "weights" if not _weights_finite(model) else f"validation loss ({eval_metrics['loss']})"
                raise NonFiniteLossError(f"epoch {epoch + 1} ended with non-finite {what}; it is not saved and {kept()}")
            if ema is not None:
                ema_metrics = evaluate(ema.module, val_loader, env, cfg.amp.enabled, cfg.amp.dtype, cfg.channels_last)
                eval_metrics["ema_top1"] = ema_metrics["top1"]
            is_best = best_top1 is None or eval_metrics["top1"] > best_top1
            best_top1 = eval_metrics["top1"] if is_best else best_top1
            wall_time += time.perf_counter() - t0
            last_metrics = {"top1": eval_metrics["top1"], "top5": eval_metrics["top5"], "val_loss": eval_metrics["loss"],
                            "train_loss": result.loss}
            if env.is_main:
                ckpt.save(checkpoint_state(epoch, 0, None, None), is_best=is_best)
            log.info("epoch %d/%d  train loss %.4f  lr %.2e  val top1 %.2f top5 %.2f loss %.4f  best %.2f  "
                     "(%.1f s, %.0f img/s)", epoch + 1, cfg.epochs, result.loss, result.lr, eval_metrics["top1"],
                     eval_metrics["top5"], eval_metrics["loss"], best_top1, time.perf_counter() - t0,
                     result.images_per_s)
            wandb.log({"epoch": epoch + 1, "train/loss": result.loss, "train/lr": result.lr,
                       "train/images_per_s": result.images_per_s, "val/top1": eval_metrics["top1"],
                       "val/top5": eval_metrics["top5"], "val/loss": eval_metrics["loss"], "val/best_top1": best_top1,
                       **({"val/ema_top1": eval_metrics["ema_top1"]} if ema is not None else {})},
                      step=(epoch + 1) * steps_per_epoch)
            if result.interrupted:
                log.info("stop requested (SIGTERM) on the last step of epoch %d: saved it to %s; rerun the same "
                         "command to resume", epoch + 1, ckpt.last)
                return {**last_metrics, "best_top1": best_top1, "epoch": epoch + 1, "wall_time_s": wall_time,
                        "preempted": True}
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        wandb.finish()
    if start_epoch >= cfg.epochs:
        log.info("%s already holds a finished run of %d epochs", folder.path, cfg.epochs)
    return {**last_metrics, "best_top1": best_top1, "epoch": cfg.epochs, "wall_time_s": wall_time}
