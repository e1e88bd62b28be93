"""The classification loops, in small parts: :func:`forward_step` and :func:`backward_step` (per
micro-batch) and :func:`optimizer_step` make :func:`train_step` (one optimizer step over
``accum_steps`` micro-batches and what advances with it), :func:`train_one_epoch` adds the epoch's
accounting and logging; :func:`evaluate` and :func:`measure_throughput`."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
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
    "StepCheck",
    "StepChecks",
    "skips_on_device",
    "allocate_grads",
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


@dataclass
class StepCheck:
    """What one step found, as the host reads it: a non-finite loss or gradient on any rank, a stop asked for on any
    rank, and the step's loss and place (for the message)."""

    flags: Tensor  # [non-finite, stop] summed over ranks; on the host behind ``ready`` when deferred on CUDA
    ready: Any  # the CUDA event recorded after the copy to the host, or None
    skip: Tensor | None  # deferred: 1 where the update is to be skipped, else 0 (0-dim, on the device)
    loss: Tensor
    where: str  # "epoch E, step S (global step G)", 1-based as logged
    stop: bool  # this process was asked to stop


class StepChecks:
    """Each step's verdicts, read by the host at once or one step late.

    Every step sums two flags over the ranks on the device (one tiny all-reduce): its losses or gradients are not all
    finite, and a stop was asked for. ``deferred`` (an optimizer that skips a step on a device flag, as torch's fused
    Adam takes ``found_inf``): the step's update is skipped on the device if it is non-finite, the flags travel to
    pinned host memory behind a CUDA event, and the host reads them during the next step, waiting for that event
    only, never for the whole queue: it stays a step ahead of the GPU, which is what CUDA graphs are for. Else the
    host reads them before the optimizer steps (on a CPU, where nothing runs ahead, that costs nothing)."""

    def __init__(self, deferred: bool = False, distributed: bool = False) -> None:
        self.deferred, self.distributed = deferred, distributed
        self.pending: StepCheck | None = None

    def check(self, state: TrainState, losses: Tensor, loss: Tensor, stop: bool, where: str) -> StepCheck:
        """The flags of a step whose micro-batches gave ``losses`` (gradients accumulated), on their way to the host."""
        flags = torch.zeros(2, device=losses.device)
        flags[0] = (~torch.isfinite(losses)).any()
        grads = [p.grad for p in state.model.parameters() if p.grad is not None]
        if grads and not state.scaler.is_enabled():  # fp16's scaler checks its scaled gradients itself
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flags[0:1], torch.ones(1, device=flags.device))
        if self.distributed:
            flags[1].fill_(float(stop))  # a kernel with the value as its argument: no copy from the host
            all_reduce_sum(flags)
        skip = flags[0].clamp(max=1.0) if self.deferred else None
        ready = None
        if self.deferred and flags.device.type == "cuda":
            host = torch.empty(2, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            flags = host
        return StepCheck(flags, ready, skip, loss, where, stop)

    def settle(self, check: StepCheck) -> bool:
        """Whether ``check``'s step asked to stop (on any rank); a NonFiniteLossError if it was not finite, its update
        not applied."""
        if self.deferred:  # a copy in host memory, written once this event is reached: no wait for the queue
            if check.ready is not None:
                check.ready.synchronize()
            non_finite, stop = check.flags.tolist()
        else:  # the device's values, read now (on a GPU, a wait for everything queued)
            non_finite, stop = check.flags[0].item(), check.flags[1].item()
        if non_finite:
            loss = check.loss.item()
            what = f"loss ({loss})" if not math.isfinite(loss) else f"gradients (loss {loss:.4g})"
            raise NonFiniteLossError(f"non-finite {what} at {check.where}; the last good checkpoint is kept")
        return stop > 0 if self.distributed else check.stop

    def earlier(self) -> bool:
        """Settle the pending step (deferred; the epoch's last at its end): whether it asked to stop."""
        pending, self.pending = self.pending, None
        return pending is not None and self.settle(pending)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips a step on a device flag, so the host need not read one first: torch's fused Adam
    and AdamW take ``found_inf``."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def backward_step(state: TrainState, loss: Tensor, share: float) -> None:
    """Add the gradients of ``share`` × ``loss`` (scaled where fp16 needs it)."""
    state.scaler.scale(loss * share).backward()


def gradient_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Around a micro-batch's forward and backward: ``sync=False`` keeps DDP from all-reducing its
    gradients (the inner micro-batches of an accumulated step; DDP decides in the forward)."""
    ddp = getattr(model, "_orig_mod", model)  # a compiled DDP module is DDP underneath
    return ddp.no_sync() if isinstance(ddp, DistributedDataParallel) and not sync else contextlib.nullcontext()


def optimizer_step(state: TrainState, clip_grad: float | None, found_inf: Tensor | None = None) -> None:
    """One optimizer step on the accumulated gradients (clipped), skipped on the device where ``found_inf`` (a 0-dim
    float, 0 or 1) is 1; then clear them (in place where ``state.stable_grads``)."""
    optimizer, scaler = state.optimizer, state.scaler
    if clip_grad is not None:
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(state.train_model.parameters(), clip_grad)
    if found_inf is not None and not scaler.is_enabled():
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]  # what torch's fused Adam reads
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
    else:
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=not state.stable_grads)


def allocate_grads(state: TrainState) -> None:
    """Gradient buffers for every trainable parameter that has none, zeroed (:attr:`TrainState.stable_grads`): made
    here, outside any CUDA graph, so the backward adds into them instead of handing over its own outputs."""
    for param in state.model.parameters():
        if param.requires_grad and param.grad is None:
            param.grad = torch.zeros_like(param)


@dataclass
class StepResult:
    loss: Tensor  # detached, the mean over the step's images
    batch: int  # images in the step (this rank)
    stop: bool  # some rank was asked to stop: leave after this step


def train_step(
    state: TrainState,
    micro_batches: Sequence[tuple[Tensor, Tensor]],
    opts: TrainOptions,
    checks: StepChecks | None = None,
) -> StepResult:
    """One optimizer step of ``state`` on its micro-batches (their gradients averaged, as one batch of
    them all would give), and everything that advances with it (the step counters, the EMA, the
    per-step schedule). A non-finite loss or gradient on any rank stops every rank with the weights as the last
    finite step left them (:class:`StepChecks`: at once, or a step late with the bad update skipped on the device);
    a stop request is honoured only here, after a whole step, so a resume never splits one."""
    checks = checks if checks is not None else StepChecks()
    update = state.global_step(opts.steps_per_epoch)
    where = f"epoch {state.epoch + 1}, step {state.step_in_epoch + 1} (global step {update + 1})"
    if state.stable_grads:
        allocate_grads(state)
    losses, sizes = [], []
    for index, (images, targets) in enumerate(micro_batches):
        with gradient_sync(state.train_model, sync=index == len(micro_batches) - 1):
            loss, batch = forward_step(state.train_model, images, targets, opts)
            backward_step(state, loss, 1 / len(micro_batches))
        losses.append(loss.detach())
        sizes.append(batch)
    total = sum(sizes)
    # Weighted by Python numbers: a tensor of the sizes would be a copy to the device, which waits for it.
    if len(losses) == 1:
        loss = losses[0]
    else:
        loss = torch.stack([part * (size / total) for part, size in zip(losses, sizes, strict=True)]).sum()
    check = checks.check(state, torch.stack(losses), loss, opts.stop_requested(), where)
    if checks.deferred:  # the step before this one is read now; this one, during the next
        earlier = checks.earlier()
        stop = earlier if checks.distributed else check.stop
        optimizer_step(state, opts.clip_grad, found_inf=check.skip)
        checks.pending = check
    else:
        stop = checks.settle(check)
        optimizer_step(state, opts.clip_grad)
    state.step_in_epoch += 1
    if state.ema is not None:
        state.ema.update(state.train_model, step=update + 1)
    state.scheduler.step_update(num_updates=update + 1)
    return StepResult(loss, total, stop)


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
    checks = StepChecks(deferred=skips_on_device(state.optimizer), distributed=env.world_size > 1)
    batches = batches_until_stopped(batches, grace)
    if meter is not None:
        meter.start_pass()
        batches = meter.timed(batches)
    try:
        for micro_batches in optimizer_steps(batches, opts.accum_steps, remaining):
            step_number = state.global_step(opts.steps_per_epoch) + 1  # 1-based, as metrics.jsonl counts
            if profiler is not None:
                profiler.before_step(step_number)
            step = train_step(state, micro_batches, opts, checks)
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
            raise UserError(
                f"rank {env.rank}: stopped by {stopped} (a read is stuck?); leaving without saving: the last "
                "checkpoint stands"
            ) from None
        log.warning("stop requested: %s; the wait is abandoned, the finished steps saved", stopped)
        interrupted = True
    finally:
        progress.close()
    interrupted = checks.earlier() or interrupted  # the last step's verdict (deferred), before anything is saved
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
