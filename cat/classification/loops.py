"""The classification loops, in small parts: :func:`forward_step` and :func:`backward_step` (per
micro-batch) and :func:`optimizer_step` make :func:`train_step` (one optimizer step over
``accum_steps`` micro-batches and what advances with it), :func:`train_one_epoch` adds the epoch's
accounting and logging; :func:`evaluate` and :func:`measure_throughput`."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from cat.errors import UserError
from cat.runtime.amp import Precision
from cat.runtime.clock import time_calls
from cat.runtime.console import StepProgress
from cat.runtime.dist import DistEnv, all_reduce_sum
from cat.runtime.logger import RUN_LOGGER
from cat.runtime.meter import IntervalStats, StepMeter
from cat.runtime.preemption import StopWhileWaiting, batches_until_stopped
from cat.runtime.profiling import ProfileWindow

from .state import TrainState

__all__ = [
    "TrainOptions",
    "forward_step",
    "backward_step",
    "gradient_sync",
    "optimizer_step",
    "train_step",
    "EpochProgress",
    "EpochResult",
    "NonFiniteLossError",
    "train_one_epoch",
    "measure_throughput",
]


# How long the loop still waits for a batch after a stop signal before it abandons the wait: one process then
# saves what it finished (nothing is lost: a short grace); a rank of several leaves without saving (a long one).
STOP_WAIT_GRACE_S = {"one process": 2.0, "several": 30.0}


class NonFiniteLossError(UserError, FloatingPointError):
    """Loss or weights became NaN or infinite; training stops without saving over the last good checkpoint."""


@dataclass
class TrainOptions:
    """How an epoch trains: the loss, augmentation on the batch, precision, logging, and when to stop."""

    criterion: nn.Module = field(default_factory=nn.CrossEntropyLoss)
    precision: Precision = field(default_factory=lambda: Precision(torch.device("cpu")))
    steps_per_epoch: int = 0  # optimizer steps: for global step numbers and "step s/T" in progress lines
    accum_steps: int = 1  # micro-batches per optimizer step
    num_epochs: int = 1  # for "epoch i/N" in progress lines
    mixup_fn: Callable | None = None
    clip_grad: float | None = None
    log_interval: int = 50
    stop_requested: Callable[[], bool] = lambda: False
    log_fn: Callable[[dict[str, float | None], int], None] | None = None
    batch_transform: Callable[[Tensor], Tensor] | None = None  # on the device, before mixup (uint8 batches)
    meter: StepMeter | None = None  # time, data wait, memory, FLOP rate in each log line; None: loss and lr only
    profiler: ProfileWindow | None = None  # profile.steps of rank 0


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


def forward_step(model: nn.Module, images: Tensor, targets: Tensor, opts: TrainOptions) -> tuple[Tensor, int]:
    """The loss of one batch (moved to the device, mixed when the recipe mixes) and its size."""
    images = opts.precision.inputs(images)
    if opts.batch_transform is not None:
        images = opts.batch_transform(images)
    targets = targets.to(opts.precision.device, non_blocking=True)
    if opts.mixup_fn is not None:
        images, targets = opts.mixup_fn(images, targets)
    with opts.precision.autocast():
        return opts.criterion(model(images), targets), images.shape[0]


def agree_on_step(loss: Tensor, opts: TrainOptions) -> tuple[bool, bool]:
    """Whether the losses (a tensor of any shape) are finite on every rank, and whether any rank was
    asked to stop: one tiny all-reduce, so all ranks leave the loop together."""
    flags = torch.tensor(
        [0.0 if torch.isfinite(loss.detach()).all() else 1.0, float(opts.stop_requested())],
        device=opts.precision.device,
    )
    all_reduce_sum(flags)
    return bool(flags[0] == 0), bool(flags[1] > 0)


def backward_step(state: TrainState, loss: Tensor, share: float) -> None:
    """Add the gradients of ``share`` × ``loss`` (scaled where fp16 needs it)."""
    state.scaler.scale(loss * share).backward()


def gradient_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Around a micro-batch's forward and backward: ``sync=False`` keeps DDP from all-reducing its
    gradients (the inner micro-batches of an accumulated step; DDP decides in the forward)."""
    return model.no_sync() if isinstance(model, DistributedDataParallel) and not sync else contextlib.nullcontext()


def optimizer_step(state: TrainState, clip_grad: float | None) -> None:
    """One optimizer step on the accumulated gradients (clipped), then clear them."""
    optimizer, scaler = state.optimizer, state.scaler
    if clip_grad is not None:
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(state.train_model.parameters(), clip_grad)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


@dataclass
class StepResult:
    loss: Tensor  # detached, the mean over the step's images
    batch: int  # images in the step (this rank)
    stop: bool  # some rank was asked to stop: leave after this step


def train_step(state: TrainState, micro_batches: Sequence[tuple[Tensor, Tensor]], opts: TrainOptions) -> StepResult:
    """One optimizer step of ``state`` on its micro-batches (their gradients averaged, as one batch of
    them all would give), and everything that advances with it (the step counters, the EMA, the
    per-step schedule). A non-finite loss on any rank stops every rank before the weights change; a
    stop request is honoured only here, after a whole step, so a resume never splits one."""
    update = state.global_step(opts.steps_per_epoch)
    losses, sizes = [], []
    for index, (images, targets) in enumerate(micro_batches):
        with gradient_sync(state.train_model, sync=index == len(micro_batches) - 1):
            loss, batch = forward_step(state.train_model, images, targets, opts)
            backward_step(state, loss, 1 / len(micro_batches))
        losses.append(loss.detach())
        sizes.append(batch)
    loss = torch.stack(losses) @ torch.tensor(sizes, dtype=losses[0].dtype, device=losses[0].device) / sum(sizes)
    finite, stop = agree_on_step(torch.stack(losses), opts)
    if not finite:
        raise NonFiniteLossError(
            f"non-finite loss ({loss.item()}) at epoch {state.epoch + 1}, step {state.step_in_epoch + 1} "
            f"(global step {update + 1}); the last good checkpoint is kept"
        )
    optimizer_step(state, opts.clip_grad)
    state.step_in_epoch += 1
    if state.ema is not None:
        state.ema.update(state.train_model, step=update + 1)
    state.scheduler.step_update(num_updates=update + 1)
    return StepResult(loss, sum(sizes), stop)


def optimizer_steps(
    batches: Iterable[tuple[Tensor, Tensor]], accum_steps: int, steps: int
) -> Iterator[list[tuple[Tensor, Tensor]]]:
    """``batches`` in groups of ``accum_steps``, at most ``steps`` groups; an incomplete last group
    is left out."""
    iterator = iter(batches)
    for _ in range(steps):
        group = [batch for _, batch in zip(range(accum_steps), iterator, strict=False)]
        if len(group) < accum_steps:
            return
        yield group


def _progress_fields(loss: Tensor, lr: float, stats: IntervalStats | None) -> dict[str, str]:
    """The progress bar's fields after a step (made only when the bar is drawn: ``loss.item()`` waits for it)."""
    return {"loss": f"{loss.item():.4f}", "lr": f"{lr:.2e}", **(stats.fields() if stats is not None else {})}


def _interval_stats(state: TrainState, opts: TrainOptions) -> IntervalStats | None:
    """The meter's numbers for the interval ending at this step (every rank calls it at the same steps)."""
    if opts.meter is None:
        return None
    left_in_epoch = opts.steps_per_epoch - state.step_in_epoch
    epochs_after = opts.num_epochs - state.epoch - 1
    return opts.meter.interval(left_in_epoch, left_in_epoch + epochs_after * opts.steps_per_epoch, epochs_after + 1)


def _interval_name(state: TrainState, opts: TrainOptions) -> str:
    last = state.step_in_epoch
    return f"epoch {state.epoch + 1} steps {max(1, last - opts.log_interval + 1)}-{last}"


def train_one_epoch(
    state: TrainState,
    batches: Iterable[tuple[Tensor, Tensor]],
    env: DistEnv,
    opts: TrainOptions,
    carried: EpochProgress | None = None,
) -> EpochResult:
    """Train ``state.train_model`` on ``batches``: epoch ``state.epoch`` (0-based; logs count from
    1), from its step ``state.step_in_epoch``, which it advances. ``carried`` is what the epoch's
    earlier part did (a resumed epoch), so the result covers the whole epoch."""
    state.train_model.train()
    carried = carried or EpochProgress()
    loss_sum = torch.tensor(carried.loss_sum, dtype=torch.float64, device=env.device)
    seen, steps, interrupted = carried.images, 0, False
    start = time.perf_counter()
    log, meter, profiler = logging.getLogger(RUN_LOGGER), opts.meter, opts.profiler
    progress = StepProgress(
        f"epoch {state.epoch + 1}/{opts.num_epochs}",
        opts.steps_per_epoch,
        state.step_in_epoch,
        opts.log_interval,
        env.is_main,
        log,
    )
    grace = STOP_WAIT_GRACE_S["one process" if env.world_size == 1 else "several"]
    remaining = opts.steps_per_epoch - state.step_in_epoch
    batches = batches_until_stopped(batches, grace)
    if meter is not None:
        meter.start_pass()
        batches = meter.timed(batches)
    try:
        for micro_batches in optimizer_steps(batches, opts.accum_steps, remaining):
            step_number = state.global_step(opts.steps_per_epoch) + 1  # 1-based, as metrics.jsonl counts
            if profiler is not None:
                profiler.before_step(step_number)
            step = train_step(state, micro_batches, opts)
            if profiler is not None:
                profiler.after_step(step_number)
            if meter is not None:
                meter.step_done(step.batch)
            steps += 1
            loss_sum += step.loss.double() * step.batch
            seen += step.batch
            lr = state.optimizer.param_groups[0]["lr"]
            due = state.step_in_epoch % opts.log_interval == 0
            stats = _interval_stats(state, opts) if due else None
            progress.update(functools.partial(_progress_fields, step.loss, lr, stats))
            if due and opts.log_fn is not None:
                metrics: dict[str, float] = {"train/loss_step": step.loss.item(), "train/lr": lr}
                opts.log_fn({**metrics, **(stats.metrics() if stats is not None else {})}, step_number)
            warning = (
                meter.data_bound_warning(stats, _interval_name(state, opts))
                if meter is not None and stats is not None
                else None
            )
            if warning is not None and env.is_main:
                log.warning("%s", warning)
            if step.stop:
                interrupted = True
                break
    except StopWhileWaiting as stopped:
        if env.world_size > 1:  # its peers may be inside a step's collectives: nothing can be saved together
            progress.close()
            raise UserError(
                f"rank {env.rank}: stopped by {stopped} (a read is stuck?); leaving without saving: the last "
                "checkpoint stands"
            ) from None
        log.warning("stop requested: %s; the wait is abandoned, the finished steps saved", stopped)
        interrupted = True
    progress.close()
    elapsed = carried.seconds + time.perf_counter() - start
    mine = EpochProgress(loss_sum=loss_sum.item(), images=seen, seconds=elapsed)
    totals = all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(seen), dtype=torch.float64, device=env.device)]))
    return EpochResult(
        loss=(totals[0] / totals[1].clamp(min=1)).item(),
        lr=state.optimizer.param_groups[0]["lr"],
        images_per_s=totals[1].item() / max(elapsed, 1e-9),
        steps=steps,
        interrupted=interrupted,
        progress=mine,
    )


@torch.inference_mode()
def measure_throughput(
    model: nn.Module,
    batch_size: int,
    img_size: tuple[int, int],
    precision: Precision,
    warmup: int = 10,
    iters: int = 30,
) -> dict[str, Any]:
    """Forward images/s of ``model`` on random input; warm-up iterations are not timed."""
    model.eval()
    x = precision.inputs(torch.randn(batch_size, 3, *img_size))
    with precision.autocast():
        (elapsed,) = time_calls(lambda: model(x), iters, warmup, precision.device)
    return {
        "throughput_img_s": batch_size * iters / elapsed,
        "batch_size": batch_size,
        "img_size": list(img_size),
        "ms_per_batch": 1e3 * elapsed / iters,
    }
