"""Wall-clock timing of work on a device: synchronised so a clock read means the work is done. The trainers'
throughput mode and the tools' benchmarks (:mod:`cat.toolkit.timing`) time with it."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["synchronize", "time_calls"]


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
