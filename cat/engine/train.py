"""The classification loops: train_one_epoch, evaluate, measure_throughput (DeiT-engine plain)."""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import Tensor, nn

from cat.errors import UserError
from cat.runtime.console import StepProgress, progress_bar
from cat.runtime.dist import DistEnv, all_reduce_sum

__all__ = ["TrainOptions", "EpochProgress", "EpochResult", "NonFiniteLossError", "train_one_epoch", "evaluate", "measure_throughput",
           "autocast_for"]


class NonFiniteLossError(UserError, FloatingPointError):
    """Loss or weights became NaN or infinite; training stops without saving over the last good checkpoint."""


_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_for(device: torch.device, enabled: bool, dtype: str) -> contextlib.AbstractContextManager:
    if not enabled:
        return contextlib.nullcontext()
    if dtype not in _AMP_DTYPES:
        raise ValueError(f"amp.dtype must be one of {sorted(_AMP_DTYPES)}, got {dtype!r}")
    return torch.autocast(device.type, dtype=_AMP_DTYPES[dtype])


@dataclass
class TrainOptions:
    clip_grad: float | None = None
    amp: bool = False
    amp_dtype: str = "bf16"
    channels_last: bool = False
    log_interval: int = 50
    num_epochs: int = 1  # for "epoch i/N" in progress lines


@dataclass
class EpochProgress:
    """What an epoch has done so far, kept in a mid-epoch checkpoint so a resumed epoch reports it whole."""

    loss_sum: float = 0.0
    images: int = 0
    seconds: float = 0.0


@dataclass
class EpochResult:
    loss: float
    lr: float
    images_per_s: float
    steps: int  # completed in this call
    interrupted: bool = False  # stopped early on request (preemption)
    progress: EpochProgress = field(default_factory=EpochProgress)  # this rank's totals, earlier parts included


def train_one_epoch(model: nn.Module, loader: Iterable[tuple[Tensor, Tensor]], criterion: nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler, scaler: torch.amp.GradScaler, env: DistEnv,
                    epoch: int, first_update: int, opts: TrainOptions, mixup_fn: Callable | None = None,
                    ema: nn.Module | None = None, stop_requested: Callable[[], bool] = lambda: False,
                    log_fn: Callable[[dict[str, float], int], None] | None = None,
                    steps_per_epoch: int | None = None, first_step: int = 0,
                    carried: EpochProgress | None = None) -> EpochResult:
    """One pass over ``loader`` (0-based ``epoch``; logs count from 1). ``first_update`` is the global
    optimizer step the pass starts at, ``first_step`` its step within the epoch (a resumed epoch), and
    ``carried`` what the epoch's earlier part did, so the result covers the whole epoch.

    Every step, all ranks agree (one tiny all-reduce) on whether the loss is finite and whether a
    stop was requested, so they leave the loop together.
    """
    model.train()
    device = env.device
    carried = carried or EpochProgress()
    loss_sum = torch.tensor(carried.loss_sum, dtype=torch.float64, device=device)
    seen = carried.images
    steps = 0
    interrupted = False
    start = time.perf_counter()
    progress = StepProgress(f"epoch {epoch + 1}/{opts.num_epochs}", steps_per_epoch or 0, first_step,
                            opts.log_interval, env.is_main, logging.getLogger("cat"))
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if opts.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if mixup_fn is not None:
            images, targets = mixup_fn(images, targets)
        with autocast_for(device, opts.amp, opts.amp_dtype):
            loss = criterion(model(images), targets)

        flags = torch.tensor([0.0 if torch.isfinite(loss.detach()) else 1.0, float(stop_requested())], device=device)
        all_reduce_sum(flags)
        if flags[0] > 0:
            raise NonFiniteLossError(f"non-finite loss ({loss.item()}) at epoch {epoch + 1}, step "
                                     f"{first_step + steps + 1} (global step {first_update + steps + 1}); "
                                     "the last good checkpoint is kept")

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if opts.clip_grad is not None:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), opts.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        steps += 1
        if ema is not None:
            ema.update(model, step=first_update + steps)
        scheduler.step_update(num_updates=first_update + steps)

        loss_sum += loss.detach().double() * images.shape[0]
        seen += images.shape[0]
        lr = optimizer.param_groups[0]["lr"]
        progress.update(lambda: {"loss": f"{loss.item():.4f}", "lr": f"{lr:.2e}"})
        if log_fn is not None and steps % opts.log_interval == 0:
            log_fn({"train/loss_step": loss.item(), "train/lr": lr}, first_update + steps)
        if flags[1] > 0:
            interrupted = True
            break
    progress.close()
    elapsed = carried.seconds + time.perf_counter() - start
    mine = EpochProgress(loss_sum=loss_sum.item(), images=seen, seconds=elapsed)
    totals = all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(seen), dtype=torch.float64, device=device)]))
    return EpochResult(loss=(totals[0] / totals[1].clamp(min=1)).item(), lr=optimizer.param_groups[0]["lr"],
                       images_per_s=totals[1].item() / max(elapsed, 1e-9), steps=steps, interrupted=interrupted,
                       progress=mine)


@torch.no_grad()
def evaluate(model: nn.Module, loader: Iterable[tuple[Tensor, Tensor]], env: DistEnv, amp: bool = False,
             amp_dtype: str = "bf16", channels_last: bool = False) -> dict[str, float]:
    """Top-1, top-5 (percent) and mean cross-entropy over the whole split, summed across ranks."""
    model.eval()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    totals = torch.zeros(4, dtype=torch.float64, device=env.device)  # loss, top1, top5, count
    for images, targets in progress_bar(loader, "eval", env.is_main):
        images = images.to(env.device, non_blocking=True)
        targets = targets.to(env.device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with autocast_for(env.device, amp, amp_dtype):
            logits = model(images)
        logits = logits.float()
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hit = top.eq(targets[:, None])
        totals += torch.stack([criterion(logits, targets).double(), hit[:, 0].sum().double(),
                               hit.any(dim=1).sum().double(), torch.tensor(float(len(targets)), dtype=torch.float64,
                                                                           device=env.device)])
    all_reduce_sum(totals)
    n = totals[3].clamp(min=1)
    return {"top1": (100 * totals[1] / n).item(), "top5": (100 * totals[2] / n).item(),
            "loss": (totals[0] / n).item(), "num_images": int(totals[3].item())}


@torch.inference_mode()
def measure_throughput(model: nn.Module, batch_size: int, img_size: tuple[int, int], device: torch.device,
                       warmup: int = 10, iters: int = 30, amp: bool = False, amp_dtype: str = "bf16",
                       channels_last: bool = False) -> dict[str, float]:
    """Forward images/s of ``model`` on random input; warm-up iterations are not timed."""
    model.eval()
    x = torch.randn(batch_size, 3, *img_size, device=device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with autocast_for(device, amp, amp_dtype):
        for _ in range(warmup):
            model(x)
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            model(x)
        sync()
    elapsed = time.perf_counter() - start
    return {"throughput_img_s": batch_size * iters / elapsed, "batch_size": batch_size,
            "img_size": list(img_size), "ms_per_batch": 1e3 * elapsed / iters}

