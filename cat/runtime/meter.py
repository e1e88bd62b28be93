"""Where a training run's time and memory go, interval by interval: step time and the part of it spent waiting
for data, images/s, peak memory, the FLOP rate and MFU, and the time left. :class:`StepMeter` keeps the sums as
the loop runs; :class:`IntervalStats` is what one log line and one ``metrics.jsonl`` row carry (its fields are the
row's keys, documented once here and in the README)."""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from .dist import all_reduce_sum
from .memory import read_memory, reset_peak_memory

__all__ = ["WARMUP_STEPS", "DATA_BOUND_SHARE", "IntervalStats", "StepMeter"]

T = TypeVar("T")
# Steps after a process starts left out of the running mean behind the ETA (compilation, the allocator's first
# growth, cuDNN's algorithm search), and steps after each epoch's start left out of the data-bound check (the
# loader's processes start there).
WARMUP_STEPS = 3
# An interval whose steps wait on data for more than this share of their time is data-bound (said once a run).
DATA_BOUND_SHARE = 0.3


def _stat(doc: str) -> Any:
    return field(default=None, metadata={"doc": doc})


@dataclass
class IntervalStats:
    """One interval's numbers (all ``None`` where not known): a ``metrics.jsonl`` row's ``train/<field>`` keys, named
    as the epoch's training metrics are (``train/loss``)."""

    eta_s: float | None = _stat(
        "seconds until the run ends: its steps left at the running mean step time (warm-up left out) plus its "
        "evaluations left at their mean (once one has run)"
    )
    epoch_eta_s: float | None = _stat("seconds until this epoch's last step, at the same mean")
    step_s: float | None = _stat("mean seconds per optimizer step over the interval (rank 0)")
    data_s: float | None = _stat("of which waiting for the data loader's next batch")
    data_share: float | None = _stat("data_s / step_s, 0-1: near 1, the run is data-bound")
    img_s: float | None = _stat("training images per second of this process over the interval")
    img_s_global: float | None = _stat("the same summed over every process")
    mem_peak_mib: float | None = _stat(
        "peak memory since the last line, MiB: CUDA's max allocated; CPU: the process's peak resident set"
    )
    mem_reserved_mib: float | None = _stat("CUDA: the allocator's max reserved since the last line; CPU: null")
    mem_growth_mib: float | None = _stat("mem_peak_mib minus what the process held at the last line")
    tflops: float | None = _stat(
        "achieved training TFLOP/s of this process: 3 x the forward's FLOPs per image (cat.flops) x img_s"
    )
    mfu: float | None = _stat(
        "tflops / the GPU's listed peak for the run's dtype (cat.runtime.hardware), 0-1; null on CPU or an unlisted GPU"
    )

    def metrics(self) -> dict[str, float | None]:
        return {f"train/{name}": value for name, value in dataclasses.asdict(self).items()}

    def fields(self) -> dict[str, str]:
        """The log line's part: ``eta``, ``step``, ``data``, ``img/s``, ``mem``, ``tflops``, ``mfu``."""
        shown: dict[str, str] = {}
        if self.eta_s is not None and self.epoch_eta_s is not None:
            shown["eta"] = f"{_clock(self.eta_s)} (epoch {_clock(self.epoch_eta_s)})"
        if self.step_s is not None and self.data_s is not None and self.data_share is not None:
            shown["step"] = f"{self.step_s:.3f}s"
            shown["data"] = f"{self.data_s:.3f}s ({100 * self.data_share:.0f}%)"
        if self.img_s is not None:
            shown["img/s"] = f"{self.img_s:.0f}" + (
                f" ({self.img_s_global:.0f} all)" if self.img_s_global not in (None, self.img_s) else ""
            )
        if self.mem_peak_mib is not None:
            reserved = f" reserved {self.mem_reserved_mib:.0f}" if self.mem_reserved_mib is not None else ""
            shown["mem"] = f"{self.mem_peak_mib:.0f}MiB{reserved} ({self.mem_growth_mib:+.0f})"
        if self.tflops is not None:
            shown["tflops"] = f"{self.tflops:.3g}"
            shown["mfu"] = f"{100 * self.mfu:.1f}%" if self.mfu is not None else "-"
        return shown


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


class StepMeter:
    """The running sums of a training process. The loop hands its batches through :meth:`timed` (the wait for
    each is data time), calls :meth:`step_done` after each optimizer step and, on every rank at the same steps,
    :meth:`interval` for a log line's numbers. ``flops_per_image``: training FLOPs per image (None: no FLOP rate);
    ``peak_tflops``: the device's peak for the run's dtype (None: no MFU)."""

    def __init__(
        self,
        device: torch.device | str = "cpu",
        flops_per_image: float | None = None,
        peak_tflops: float | None = None,
        advice: str = "",
    ) -> None:
        self.device = torch.device(device)
        self.flops_per_image, self.peak_tflops, self.advice = flops_per_image, peak_tflops, advice
        self.warned = False
        self._steps_run = 0  # since the process started
        self._steady_s, self._steady_steps = 0.0, 0
        self._evals: list[float] = []
        self._last = time.perf_counter()
        self._pass_steps = 0
        self._waiting = 0.0  # data time of the step under way
        self._interval = [0, 0.0, 0.0, 0]  # steps, seconds, data seconds, images
        self._warm_interval = True  # the interval holds a step of a pass's warm-up
        self._was_warm = True  # so did the last interval returned
        self._memory_reset = reset_peak_memory(self.device)
        self._held_mib = read_memory(self.device, self._memory_reset).now_mib

    def start_pass(self) -> None:
        """An epoch's steps begin (after an evaluation, a resume): time from here."""
        self._last, self._pass_steps, self._waiting = time.perf_counter(), 0, 0.0

    def timed(self, batches: Iterable[T]) -> Iterator[T]:
        """``batches``, the wait for each added to the step's data time."""
        iterator = iter(batches)
        while True:
            start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            finally:
                self._waiting += time.perf_counter() - start
            yield batch

    def step_done(self, images: int) -> None:
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        self._steps_run += 1
        self._pass_steps += 1
        if self._steps_run > WARMUP_STEPS:
            self._steady_s += seconds
            self._steady_steps += 1
        if self._pass_steps <= WARMUP_STEPS:
            self._warm_interval = True
        steps, total, data, seen = self._interval
        self._interval = [steps + 1, total + seconds, data + self._waiting, seen + images]
        self._waiting = 0.0

    def eval_done(self, seconds: float) -> None:
        self._evals.append(seconds)

    def interval(self, steps_left_epoch: int, steps_left_run: int, evals_left: int) -> IntervalStats:
        """The interval since the last call, and the time left (call on every rank: it sums images over ranks)."""
        steps, seconds, data, seen = self._interval
        self._interval = [0, 0.0, 0.0, 0]
        stats = IntervalStats()
        total = torch.tensor([float(seen)], dtype=torch.float64, device=self.device)
        all_reduce_sum(total)
        if steps:
            stats.step_s, stats.data_s = seconds / steps, data / steps
            stats.data_share = data / seconds if seconds > 0 else 0.0
            stats.img_s = seen / max(seconds, 1e-9)
            stats.img_s_global = total.item() / max(seconds, 1e-9)
        if self._steady_steps:
            mean = self._steady_s / self._steady_steps
            stats.epoch_eta_s = steps_left_epoch * mean
            evals = evals_left * sum(self._evals) / len(self._evals) if self._evals else 0.0
            stats.eta_s = steps_left_run * mean + evals
        memory = read_memory(self.device, self._memory_reset)
        stats.mem_peak_mib = memory.peak_mib
        stats.mem_reserved_mib = memory.reserved_mib
        stats.mem_growth_mib = memory.peak_mib - self._held_mib
        self._memory_reset = reset_peak_memory(self.device)
        self._held_mib = read_memory(self.device, self._memory_reset).now_mib
        if self.flops_per_image is not None and stats.img_s is not None:
            stats.tflops = self.flops_per_image * stats.img_s / 1e12
            if self.peak_tflops is not None:
                stats.mfu = stats.tflops / self.peak_tflops
        self._was_warm, self._warm_interval = self._warm_interval, False
        return stats

    def data_bound_warning(self, stats: IntervalStats, steps: str) -> str | None:
        """The one warning of a run whose interval (``steps``, as logged) waited on data for more than
        :data:`DATA_BOUND_SHARE` of its time, past the epoch's warm-up; None otherwise, and after the first."""
        if self.warned or self._was_warm or stats.data_share is None or stats.data_share <= DATA_BOUND_SHARE:
            return None
        self.warned = True
        return (
            f"data-bound: {steps} waited {100 * stats.data_share:.0f}% of their time for the data loader "
            f"(more than {100 * DATA_BOUND_SHARE:.0f}%; {stats.data_s:.3f}s of {stats.step_s:.3f}s per step): "
            f"the model waits for its input. {self.advice}"
        ).strip()
