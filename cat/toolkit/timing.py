"""Timing that means something: device synchronisation, warm-up, per-call samples, interleaved
medians (slow drifts of the machine hit every candidate alike) and peak memory."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["synchronize", "time_calls", "interleaved_medians", "reset_peak_memory", "peak_memory_mib"]


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on CPU), so a clock read means the work is done."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(
    fn: Callable[[], object], iters: int, warmup: int, device: torch.device | str, per_call: bool = False
) -> list[float]:
    """Seconds taken by ``fn`` after ``warmup`` untimed calls: one sample for all ``iters`` calls
    together, or (``per_call``) one sample per call, each between two synchronisations."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    start = time.perf_counter()
    for _ in range(iters):
        fn()
        if per_call:
            synchronize(device)
            now = time.perf_counter()
            samples.append(now - start)
            start = now
    if not per_call:
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return samples


def interleaved_medians(fns: dict[str, Callable[[], object]], rounds: int, min_block_s: float) -> dict[str, float]:
    """Median seconds per call of each function, with ``torch.utils.benchmark`` (which synchronises
    CUDA): every round times one block of each function in turn."""
    from torch.utils import benchmark  # imports torch's C++-extension builder, which warns without CUDA

    timers = {name: benchmark.Timer(stmt="fn()", globals={"fn": fn}) for name, fn in fns.items()}
    reps = {}
    for name, timer in timers.items():  # warm-up, and size each block to about min_block_s
        once = timer.timeit(1).mean
        reps[name] = max(1, int(min_block_s / max(once, 1e-6)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, timer in timers.items():
            samples[name].append(timer.timeit(reps[name]).mean)
    return {name: float(np.median(s)) for name, s in samples.items()}


def reset_peak_memory(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device | str) -> float:
    """CUDA: peak allocated since the last reset; CPU: this process's lifetime peak resident set."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
