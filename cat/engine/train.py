"""The classification loops: train_one_epoch, evaluate, measure_throughput (DeiT-engine plain)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from cat.errors import UserError
from cat.runtime.amp import autocast_for
from cat.runtime.console import StepProgress, progress_bar
from cat.runtime.dist import DistEnv, all_reduce_sum
from cat.toolkit.timing import time_calls

from .state import TrainState

__all__ = [
    "TrainOptions",
    "EpochProgress",
    "EpochResult",
    "NonFiniteLossError",
    "train_one_epoch",
    "evaluate",
    "measure_throughput",
]


class NonFiniteLossError(UserError, FloatingPointError):
    """Loss or weights became NaN or infinite; training stops without saving over the last good checkpoint."""


@dataclass
class TrainOptions:
    """How an epoch trains: the loss, augmentation on the batch, precision, logging, and when to stop."""

    criterion: nn.Module = field(default_factory=nn.CrossEntropyLoss)
    steps_per_epoch: int = 0  # for global step numbers and "step s/T" in progress lines
    num_epochs: int = 1  # for "epoch i/N" in progress lines
    mixup_fn: Callable | None = None
    clip_grad: float | None = None
    amp: bool = False
    amp_dtype: str = "bf16"
    channels_last: bool = False
    log_interval: int = 50
    stop_requested: Callable[[], bool] = lambda: False
    log_fn: Callable[[dict[str, float], int], None] | None = None


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


def train_one_epoch(
    state: TrainState,
    batches: Iterable[tuple[Tensor, Tensor]],
    env: DistEnv,
    opts: TrainOptions,
    carried: EpochProgress | None = None,
) -> EpochResult:
    """Train ``state.train_model`` on ``batches``: epoch ``state.epoch`` (0-based; logs count from
    1), from its step ``state.step_in_epoch``, which it advances. ``carried`` is what the epoch's
    earlier part did (a resumed epoch), so the result covers the whole epoch.

    Every step, all ranks agree (one tiny all-reduce) on whether the loss is finite and whether a
    stop was requested, so they leave the loop together.
    """
    model, optimizer, scaler = state.train_model, state.optimizer, state.scaler
    model.train()
    device = env.device
    epoch, first_step = state.epoch, state.step_in_epoch
    first_update = state.global_step(opts.steps_per_epoch)
    carried = carried or EpochProgress()
    loss_sum = torch.tensor(carried.loss_sum, dtype=torch.float64, device=device)
    seen = carried.images
    steps = 0
    interrupted = False
    start = time.perf_counter()
    progress = StepProgress(
        f"epoch {epoch + 1}/{opts.num_epochs}",
        opts.steps_per_epoch,
        first_step,
        opts.log_interval,
        env.is_main,
        logging.getLogger("cat"),
    )
    for images, targets in batches:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if opts.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if opts.mixup_fn is not None:
            images, targets = opts.mixup_fn(images, targets)
        with autocast_for(device, opts.amp, opts.amp_dtype):
            loss = opts.criterion(model(images), targets)

        flags = torch.tensor(
            [0.0 if torch.isfinite(loss.detach()) else 1.0, float(opts.stop_requested())], device=device
        )
        all_reduce_sum(flags)
        if flags[0] > 0:
            raise NonFiniteLossError(
                f"non-finite loss ({loss.item()}) at epoch {epoch + 1}, step "
                f"{first_step + steps + 1} (global step {first_update + steps + 1}); "
                "the last good checkpoint is kept"
            )

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if opts.clip_grad is not None:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), opts.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        steps += 1
        state.step_in_epoch = first_step + steps
        if state.ema is not None:
            state.ema.update(model, step=first_update + steps)
        state.scheduler.step_update(num_updates=first_update + steps)

        loss_sum += loss.detach().double() * images.shape[0]
        seen += images.shape[0]
        lr = optimizer.param_groups[0]["lr"]
        progress.update(lambda loss=loss, lr=lr: {"loss": f"{loss.item():.4f}", "lr": f"{lr:.2e}"})
        if opts.log_fn is not None and steps % opts.log_interval == 0:
            opts.log_fn({"train/loss_step": loss.item(), "train/lr": lr}, first_update + steps)
        if flags[1] > 0:
            interrupted = True
            break
    progress.close()
    elapsed = carried.seconds + time.perf_counter() - start
    mine = EpochProgress(loss_sum=loss_sum.item(), images=seen, seconds=elapsed)
    totals = all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(seen), dtype=torch.float64, device=device)]))
    return EpochResult(
        loss=(totals[0] / totals[1].clamp(min=1)).item(),
        lr=optimizer.param_groups[0]["lr"],
        images_per_s=totals[1].item() / max(elapsed, 1e-9),
        steps=steps,
        interrupted=interrupted,
        progress=mine,
    )


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[tuple[Tensor, Tensor]],
    env: DistEnv,
    amp: bool = False,
    amp_dtype: str = "bf16",
    channels_last: bool = False,
) -> dict[str, float]:
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
        totals += torch.stack(
            [
                criterion(logits, targets).double(),
                hit[:, 0].sum().double(),
                hit.any(dim=1).sum().double(),
                torch.tensor(float(len(targets)), dtype=torch.float64, device=env.device),
            ]
        )
    all_reduce_sum(totals)
    n = totals[3].clamp(min=1)
    return {
        "top1": (100 * totals[1] / n).item(),
        "top5": (100 * totals[2] / n).item(),
        "loss": (totals[0] / n).item(),
        "num_images": int(totals[3].item()),
    }


@torch.inference_mode()
def measure_throughput(
    model: nn.Module,
    batch_size: int,
    img_size: tuple[int, int],
    device: torch.device,
    warmup: int = 10,
    iters: int = 30,
    amp: bool = False,
    amp_dtype: str = "bf16",
    channels_last: bool = False,
) -> dict[str, float]:
    """Forward images/s of ``model`` on random input; warm-up iterations are not timed."""
    model.eval()
    x = torch.randn(batch_size, 3, *img_size, device=device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with autocast_for(device, amp, amp_dtype):
        (elapsed,) = time_calls(lambda: model(x), iters, warmup, device)
    return {
        "throughput_img_s": batch_size * iters / elapsed,
        "batch_size": batch_size,
        "img_size": list(img_size),
        "ms_per_batch": 1e3 * elapsed / iters,
    }
