"""Memory a process holds and the most it held since a reset: CUDA's allocator on a GPU, the resident set on a
CPU (Linux can reset its peak, ``/proc/self/clear_refs``; elsewhere ``getrusage``'s lifetime peak stands in).
The trainer's interval lines (:mod:`cat.runtime.meter`) and the tools' benchmarks (:mod:`cat.toolkit.timing`) read
it."""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .clock import synchronize

__all__ = [
    "MemoryReading",
    "reset_peak_memory",
    "read_memory",
    "peak_memory_mib",
    "peak_growth_mib",
    "private_memory",
]


def _proc_status_kib(key: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS: resident now; VmHWM: peak resident)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise KeyError(key)


def _reset_cpu_peak() -> bool:
    """Reset this process's peak resident set (Linux: VmHWM) to what it holds now, if the OS can."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _proc_status_kib("VmHWM") >= 0
    except (OSError, KeyError, ValueError):
        return False


@dataclass(frozen=True)
class MemoryReading:
    """MiB held now and the peak since the last :func:`reset_peak_memory` (CUDA: allocated, and the peak
    the allocator reserved; CPU: resident, with ``reserved_mib`` None). ``since_reset`` is False where the CPU
    peak could not be reset: it is then the process's lifetime peak."""

    now_mib: float
    peak_mib: float
    reserved_mib: float | None
    since_reset: bool = True


def reset_peak_memory(device: torch.device | str) -> bool:
    """Start a new peak at what ``device`` holds now; False where that cannot be done (a CPU without Linux's
    ``clear_refs``)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    return _reset_cpu_peak()


def read_memory(device: torch.device | str, since_reset: bool = True) -> MemoryReading:
    """What ``device`` holds now and at most since the last reset (``since_reset``: whether that reset worked)."""
    device = torch.device(device)
    if device.type == "cuda":
        return MemoryReading(
            torch.cuda.memory_allocated(device) / 2**20,
            torch.cuda.max_memory_allocated(device) / 2**20,
            torch.cuda.max_memory_reserved(device) / 2**20,
        )
    try:
        return MemoryReading(_proc_status_kib("VmRSS") / 1024, _proc_status_kib("VmHWM") / 1024, None, since_reset)
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return MemoryReading(peak, peak, None, False)


def peak_memory_mib(device: torch.device | str) -> float:
    """CUDA: peak allocated since the last reset; CPU: this process's lifetime peak resident set."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_growth_mib(fn: Callable[[], object], device: torch.device | str) -> float:
    """How far one call of ``fn`` raises the peak memory above what was held before it: CUDA's peak
    allocated, or on CPU the process's peak resident set. On Linux the CPU peak is first reset to
    the current resident set (``/proc/self/clear_refs``), so earlier peaks (imports, model
    building) cannot hide the growth; elsewhere ``getrusage``'s lifetime peak is used, so call it
    in a fresh process, before anything else has raised the peak."""
    device = torch.device(device)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    if _reset_cpu_peak():
        before = _proc_status_kib("VmRSS")
        fn()
        return (_proc_status_kib("VmHWM") - before) / 1024
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def private_memory(pid: int | str = "self") -> dict[str, int]:
    """Bytes of a process's memory (Linux, ``/proc/<pid>/smaps_rollup``): ``private``, its pages no other process
    maps (a forked worker's copies of its parent's pages, what it allocated itself), and ``anonymous``, its
    memory not backed by a file (a mapped file's pages are the page cache's)."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[name] = int(value.split()[0]) * 1024
    return {"private": fields["Private_Clean"] + fields["Private_Dirty"], "anonymous": fields["Anonymous"]}
