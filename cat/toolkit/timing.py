"""Timing that means something: device synchronisation, warm-up, per-call samples, interleaved
medians (slow drifts of the machine hit every candidate alike), per-operator profiles pooled over
processes, and peak memory."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from cat.runtime.clock import synchronize, time_calls
from cat.runtime.memory import peak_growth_mib, peak_memory_mib, reset_peak_memory

__all__ = [
    "synchronize",
    "time_calls",
    "rotated",
    "interleaved_medians",
    "paired_ratios",
    "median_quartiles",
    "paired_speedups",
    "op_self_ms",
    "op_differences",
    "reset_peak_memory",
    "peak_memory_mib",
    "peak_growth_mib",
]


def rotated(names: Sequence[str], k: int) -> list[str]:
    """``names`` starting ``k`` places later (wrapping round): over ``len(names)`` rounds each takes every place in
    the order, so where a call runs in a round (on CPU that alone moved a model by 14 %) hits every name alike."""
    k %= len(names)
    return [*names[k:], *names[:k]]


def interleaved_medians(fns: dict[str, Callable[[], object]], rounds: int, min_block_s: float) -> dict[str, float]:
    """Median seconds per call of each function, with ``torch.utils.benchmark`` (which synchronises
    CUDA): every round times one block of each function in turn, starting one function later each round, so
    each takes every place in the order (on CPU the place alone moved two instances of one model by 14 %).
    The functions run with the caller's thread count (``torch.utils.benchmark`` would run them on one)."""
    from torch.utils import benchmark  # imports torch's C++-extension builder, which warns without CUDA

    timers = {
        name: benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        for name, fn in fns.items()
    }
    reps = {}
    for name, timer in timers.items():  # warm-up, and size each block to about min_block_s
        once = timer.timeit(1).mean
        reps[name] = max(1, int(min_block_s / max(once, 1e-6)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(timers)
    for r in range(rounds):
        for name in rotated(names, r):
            samples[name].append(timers[name].timeit(reps[name]).mean)
    return {name: float(np.median(s)) for name, s in samples.items()}


def paired_ratios(
    fns: dict[str, Callable[[], object]], pairs: int, device: torch.device | str
) -> dict[str, list[float]]:
    """Per candidate (every function after the first), the ratios baseline time / candidate time of ``pairs``
    single calls in pairs: the baseline, then the candidate, in alternating order. A pair's two calls are
    seconds apart, so the machine's drifts cancel within each ratio; a step of a whole model varies by 10 % on
    a shared CPU."""
    names = list(fns)
    for name in names:  # warm-up: allocator pools, lazy initialisation
        time_calls(fns[name], 1, 1, device)
    ratios: dict[str, list[float]] = {name: [] for name in names[1:]}
    for i in range(pairs):
        for name in names[1:]:
            order = (names[0], name) if i % 2 == 0 else (name, names[0])
            t = {n: time_calls(fns[n], 1, 0, device)[0] for n in order}
            ratios[name].append(t[names[0]] / t[name])
    return ratios


def median_quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, lower quartile, upper quartile)."""
    q1, median, q3 = np.quantile(values, [0.25, 0.5, 0.75])
    return float(median), float(q1), float(q3)


def paired_speedups(
    fns: dict[str, Callable[[], object]], pairs: int, device: torch.device | str
) -> dict[str, tuple[float, float, float]]:
    """Speed of each function relative to the first, from :func:`paired_ratios`: per name, the median of the
    per-pair ratios and its lower and upper quartiles (the first: 1.0 three times)."""
    names = list(fns)
    out = {names[0]: (1.0, 1.0, 1.0)}
    out.update({name: median_quartiles(r) for name, r in paired_ratios(fns, pairs, device).items()})
    return out


def op_self_ms(fns: dict[str, Callable[[], object]], calls: int) -> dict[str, dict[str, float]]:
    """Per function, the CPU time (ms) each operator spends in itself during one call (``torch.profiler``'s self
    time, which leaves out the operators it calls, so a call's entries add up to its time under the profiler): the
    median over ``calls`` profiled calls, the functions interleaved with the order alternating. Warm them up first."""
    from torch.profiler import ProfilerActivity, profile

    names = list(fns)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for i in range(calls):
        for name in names if i % 2 == 0 else names[::-1]:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fns[name]()
            samples[name].append({e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()})
    return {
        name: {op: float(np.median([s.get(op, 0.0) for s in per_call])) for op in set().union(*per_call)}
        for name, per_call in samples.items()
    }


def op_differences(runs: Sequence[dict[str, dict[str, float]]], baseline: str, name: str) -> list[dict[str, object]]:
    """Where ``name``'s time differs from ``baseline``'s, per operator, pooled over ``runs`` (each
    :func:`op_self_ms` in its own process): both medians over the runs (ms), the median of the runs' differences,
    and in how many runs ``name`` took longer. Largest difference, either sign, first. A single process's profile
    can put the same operator tens of ms apart from one run to the next on a shared CPU; a difference with the
    same sign in every process is one the two functions make."""
    ops = set().union(*(set(run[baseline]) | set(run[name]) for run in runs))
    rows: list[dict[str, Any]] = []
    for op in ops:
        base = [run[baseline].get(op, 0.0) for run in runs]
        own = [run[name].get(op, 0.0) for run in runs]
        diffs = [b - a for a, b in zip(base, own, strict=True)]
        rows.append(
            {
                "op": op,
                "baseline_ms": float(np.median(base)),
                "ms": float(np.median(own)),
                "diff_ms": float(np.median(diffs)),
                "runs_above": sum(d > 0 for d in diffs),
            }
        )
    return sorted(rows, key=lambda row: -abs(row["diff_ms"]))
