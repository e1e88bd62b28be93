"""What circulant attention's ``auto`` settings take on each device and dtype, and the memory budget they work in.

Two choices per block, both from what was measured (docs/perf.md, "Kernels per step and the auto policy"):
  the backward's inputs  stored spectra (faster on every device measured: 1.0-1.3x on a CPU, and on an H200 the lean
                         function's launches cost 4-6x), unless a model of :data:`AUTO_DEPTH` such blocks would keep
                         more than the memory budget, then the lean function (least memory). The same rule under
                         torch.compile, where a lean block runs outside the graph (:func:`lean_decisions` tells a
                         run before it compiles whether any will, so it can allow the graph breaks).
  the DFT backend        ``fft`` (cuFFT, pocketfft/MKL in float32): the fewest operators and bytes per step (no casts
                         around the transforms, no GEMM pairs). Under half-precision autocast on a GPU, what that card
                         measured instead, where ``tools/gpu_check.py`` has timed a training step with cuFFT in
                         float32 against the separable GEMM DFT in the autocast dtype and recorded the faster
                         (:func:`measured_choices_path`). On a CPU the GEMM DFTs were measured slower.
The memory budget (``model.attention_memory_mb``; :func:`set_attention_memory`) is by default a quarter of the
device's free memory when it is first asked for: CUDA's free memory, or the CPU's MemAvailable.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from .dft import DFTBackend, check_dft_backend
from .precision import autocast_state

__all__ = [
    "LeanPolicy",
    "BackendPolicy",
    "AUTO_DEPTH",
    "BUDGET_SHARE",
    "check_lean",
    "check_backend",
    "default_budget_bytes",
    "budget_bytes",
    "lean_for",
    "LeanDecision",
    "lean_decisions",
    "compute_dtype",
    "backend_for",
    "measured_choices_path",
    "measured_backend",
    "record_measured_backend",
    "describe",
    "KernelPolicy",
    "KERNEL_POLICIES",
    "check_kernel",
    "kernel_for",
    "measured_kernel",
    "record_measured_kernel",
    "tile_of",
    "gemm_precision",
]

LeanPolicy = bool | Literal["auto"]
BackendPolicy = Literal["auto", "fft", "separable", "matmul"]
KernelPolicy = Literal["auto", "triton", "aten"]
KERNEL_POLICIES: tuple[KernelPolicy, ...] = ("auto", "triton", "aten")
# The largest grid tile ``auto`` gives the kernels (:func:`tile_of`): 16 x 16 when training (its
# backward holds about twenty such tiles: at 32 x 32 they spill registers), 32 x 32 for inference on the tensor cores
# (TF32: half-precision inputs, or float32 with amp.tf32; exact float32 GEMMs spill there). Past them the ATen path.
KERNEL_TRAINING_TILE = 16
KERNEL_INFERENCE_TILE = 32
# The smallest tile the kernels' GEMMs (tl.dot) take.
MIN_TILE = 16

# ``auto`` keeps a block's spectra while a model of this many such blocks (CA-Swin-B has 24) would keep at most the
# memory budget.
AUTO_DEPTH = 24
# The default memory budget: this share of the device's free memory.
BUDGET_SHARE = 0.25

_HALF = (torch.float16, torch.bfloat16)


def check_lean(lean: object) -> LeanPolicy:
    """``lean`` if it is a lean policy: True (always the lean function), False (always stored) or 'auto'."""
    if lean is True or lean is False or lean == "auto":
        return lean
    raise ValueError(f"lean must be True, False or 'auto'; got {lean!r}")


def check_backend(backend: object) -> BackendPolicy:
    """``backend`` if it is a DFT backend (:mod:`cat.ops.dft`) or 'auto'."""
    if backend == "auto":
        return "auto"
    return check_dft_backend(backend)


def check_kernel(kernel: object) -> KernelPolicy:
    """``kernel`` if it is an attention kernel policy: 'auto', 'triton' (the Triton kernels wherever Triton runs, its
    interpreter on a CPU included) or 'aten' (the ATen path, :mod:`cat.ops.fused`)."""
    if kernel in KERNEL_POLICIES:
        return kernel
    raise ValueError(f"attention_kernel must be one of {', '.join(map(repr, KERNEL_POLICIES))}; got {kernel!r}")


def _free_bytes(device: torch.device) -> int | None:
    """Free memory on ``device``: CUDA's, or the host's MemAvailable (None where neither applies)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


_default_budgets: dict[str, int] = {}


# Read once per device, and as a constant by torch.compile (a file read cannot be traced).
@torch.compiler.assume_constant_result
def default_budget_bytes(device: str) -> int:
    """:data:`BUDGET_SHARE` of ``device``'s free memory, read the first time it is asked for (2^62 where the device
    says nothing)."""
    if device not in _default_budgets:
        free = _free_bytes(torch.device(device))
        _default_budgets[device] = int(free * BUDGET_SHARE) if free is not None else 2**62
    return _default_budgets[device]


def budget_bytes(memory_mb: int | None, device: torch.device) -> int:
    """The memory budget of a block: ``memory_mb`` MiB, or None for the device's default."""
    return memory_mb * 2**20 if memory_mb is not None else default_budget_bytes(str(device))


@dataclass(frozen=True)
class LeanDecision:
    """One block's choice (:func:`lean_for`): what its stored path would keep, the budget, and whether it goes lean."""

    stored_bytes: int
    budget: int
    lean: bool


_decisions: list[LeanDecision] | None = None


@contextlib.contextmanager
def lean_decisions() -> Iterator[list[LeanDecision]]:
    """The choices :func:`lean_for` makes while the context is open, in call order: a forward run inside (on tensors
    without data, say) tells which blocks of a model would go lean at that batch."""
    global _decisions
    outer, _decisions = _decisions, []
    try:
        yield _decisions
    finally:
        _decisions = outer


def lean_for(lean: LeanPolicy, stored_bytes: int, budget: int) -> bool:
    """Whether a block whose stored path would keep ``stored_bytes`` trains through the lean function: ``lean``, or for
    'auto' whether a model of :data:`AUTO_DEPTH` such blocks would keep more than ``budget`` (eager or compiled)."""
    chosen = bool(lean) if lean != "auto" else stored_bytes * AUTO_DEPTH > budget
    if _decisions is not None and not torch.compiler.is_compiling():
        _decisions.append(LeanDecision(stored_bytes, budget, chosen))
    return chosen


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a block computes in: autocast's where autocast is on, else its input's."""
    enabled, dtype = autocast_state(x.device)
    return dtype if enabled and dtype is not None else x.dtype


def measured_choices_path() -> Path:
    """Where ``tools/gpu_check.py`` records the DFT each card measured faster under half-precision autocast:
    ``$XDG_CACHE_HOME/cat/dft_choices.json`` (``~/.cache`` without it), {card name: {dtype: backend}}."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "cat" / "dft_choices.json"


def _read_choices(path: Path) -> dict[str, dict[str, str]]:
    """The recorded choices, or none: a record that is missing, unreadable, not a regular file or not of the
    expected shape (card -> dtype -> one of cat's DFT backends) counts as no measurement."""
    try:
        if not path.is_file() or path.stat().st_size > 2**20:
            return {}
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # RecursionError: a record nested past what json reads
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        card: {what: name for what, name in choices.items() if name in _CHOICES.get(what, ("fft", "separable"))}
        for card, choices in data.items()
        if isinstance(card, str) and isinstance(choices, dict)
    }


# What each record's key may hold: a dtype's DFT, or the attention's kernel ("kernel").
_CHOICES = {"kernel": ("triton", "aten")}


_measured: dict[str, str | None] = {}


# Read once per card and dtype, and as a constant by torch.compile (a file read cannot be traced).
@torch.compiler.assume_constant_result
def measured_backend(device: str, dtype: str) -> str | None:
    """The DFT ``tools/gpu_check.py`` measured faster on the CUDA ``device`` computing in ``dtype`` ('bfloat16',
    'float16'), or None where that card has not been measured."""
    key = f"{device}/{dtype}"
    if key not in _measured:
        _measured[key] = _read_choices(measured_choices_path()).get(_card(device), {}).get(dtype)
    return _measured[key]


def record_measured_backend(card: str, dtype: str, backend: DFTBackend) -> Path:
    """Record that ``card`` measured ``backend`` faster in ``dtype`` (what :func:`measured_backend` reads), beside
    the other cards' choices; the file is replaced whole (a temporary file renamed over it)."""
    return _record(card, dtype, check_dft_backend(backend))


def _record(card: str, what: str, choice: str) -> Path:
    """Write the record with ``card``'s ``what`` set: a new temporary file of an unpredictable name (nothing planted
    is written through), renamed over the record (a link planted there is replaced, not followed). OSError naming
    the record where its folder cannot be made or written (``XDG_CACHE_HOME=/dev/null``)."""
    path = measured_choices_path()
    choices = _read_choices(path)
    choices.setdefault(card, {})[what] = choice
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(choices, indent=2, sort_keys=True) + "\n")
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as error:
        raise OSError(error.errno, f"cannot write the record {path} ({error.strerror or error})") from None
    _measured.clear()
    return path


def _card(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if torch.cuda.is_available() else device


# Read once per card, and as a constant by torch.compile (a file read cannot be traced).
@torch.compiler.assume_constant_result
def measured_kernel(device: str) -> str | None:
    """What ``tools/gpu_check.py`` measured faster on the CUDA ``device`` for circulant attention: 'triton' (the
    kernels) or 'aten', or None where that card has not been measured."""
    key = f"{device}/kernel"
    if key not in _measured:
        _measured[key] = _read_choices(measured_choices_path()).get(_card(device), {}).get("kernel")
    return _measured[key]


def record_measured_kernel(card: str, kernel: Literal["triton", "aten"]) -> Path:
    """Record that ``card`` measured ``kernel`` faster (what :func:`measured_kernel` reads), as
    :func:`record_measured_backend` records a DFT."""
    return _record(card, "kernel", kernel)


def tile_of(side: int) -> int:
    """The kernels' tile side for a grid side: a power of two, at least :data:`MIN_TILE`."""
    return max(MIN_TILE, 1 << max(side - 1, 0).bit_length())


def gemm_precision(dtype: torch.dtype, device: torch.device) -> str:
    """The kernels' GEMM precision: TF32 tensor cores for half-precision inputs (more mantissa than they have) and for
    float32 where the run allows TF32 (``amp.tf32``); exact float32 ('ieee') otherwise."""
    if dtype in (torch.float16, torch.bfloat16):
        return "tf32"
    allowed = device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    return "tf32" if allowed else "ieee"


def kernel_for(
    kernel: KernelPolicy, device: torch.device, hw: tuple[int, int], training: bool, dtype: torch.dtype
) -> bool:
    """Whether circulant attention on ``device`` over the grid ``hw``, computing in ``dtype``, runs through the
    Triton kernels by the rule: 'triton' always, 'aten' never; 'auto' on CUDA where the grid's tile fits on chip
    (:data:`KERNEL_TRAINING_TILE`, :data:`KERNEL_INFERENCE_TILE`), unless ``tools/gpu_check.py`` measured ATen faster
    on the card. A CPU keeps the ATen path. (For 'auto' the kernels must also pass their first-use check:
    :func:`cat.ops.kernels.check.use_kernels`.)"""
    if kernel != "auto":
        return kernel == "triton"
    if device.type != "cuda":
        return False
    tensor_cores = gemm_precision(dtype, device) == "tf32"
    limit = KERNEL_INFERENCE_TILE if not training and tensor_cores else KERNEL_TRAINING_TILE
    return max(tile_of(hw[0]), tile_of(hw[1])) <= limit and measured_kernel(str(device)) != "aten"


def backend_for(backend: BackendPolicy, device: torch.device, dtype: torch.dtype) -> DFTBackend:
    """The DFT backend a block runs on ``device`` computing in ``dtype`` (:func:`compute_dtype`): ``fft``, unless
    the card measured the separable GEMM DFT faster in that half precision (:func:`measured_backend`)."""
    if backend != "auto":
        return backend
    if device.type == "cuda" and dtype in _HALF:
        measured = measured_backend(str(device), str(dtype).removeprefix("torch."))
        if measured is not None:
            return check_dft_backend(measured)
    return "fft"


def describe(
    device: torch.device,
    dtype: torch.dtype,
    lean: LeanPolicy,
    backend: BackendPolicy,
    memory_mb: int | None,
    kernel: KernelPolicy = "auto",
) -> str:
    """One line: what a block takes on ``device`` when computing in ``dtype`` (autocast's, or the model's), and why."""
    budget = budget_bytes(memory_mb, device)
    source = f"{memory_mb} MiB" if memory_mb is not None else f"{BUDGET_SHARE:.0%} of {device.type}'s free memory"
    if lean == "auto":
        path = (
            f"stored spectra while a {AUTO_DEPTH}-block model's would fit the memory budget ({budget / 2**30:.1f} GiB, "
            f"{source}), else the lean function (stored measured faster on every device)"
        )
    else:
        path = "the lean function (lean_attention=true)" if lean else "stored spectra (lean_attention=false)"
    chosen = backend_for(backend, device, dtype)
    if backend != "auto":
        why = f"fft_backend={backend}"
    elif device.type == "cuda" and dtype in _HALF:
        measured = measured_backend(str(device), str(dtype).removeprefix("torch."))
        if measured is None:
            why = "torch.fft in float32, the fewest operators and bytes: this GPU has not measured the separable GEMMs"
            why += " (tools/gpu_check.py)"
        else:
            why = f"measured faster on this GPU by tools/gpu_check.py ({measured_choices_path()})"
    else:
        why = "torch.fft in float32" + ("; GEMM DFTs were measured slower on CPUs" if device.type == "cpu" else "")
    dft = f"{chosen} DFTs ({why})"
    if kernel == "auto":
        kernels = (
            f"the Triton kernels for grids up to {KERNEL_TRAINING_TILE}x{KERNEL_TRAINING_TILE} in training and "
            f"{KERNEL_INFERENCE_TILE}x{KERNEL_INFERENCE_TILE} in inference, else the ATen path (attention_kernel=auto)"
            if device.type == "cuda"
            else "the ATen path (attention_kernel=auto: the Triton kernels on CUDA)"
        )
    else:
        kernels = "the Triton kernels" if kernel == "triton" else "the ATen path"
        kernels += f" (attention_kernel={kernel})"
    where = f"circulant attention on {device.type} in {str(dtype).removeprefix('torch.')}"
    return f"{where}: {kernels}; on the ATen path, {path}; {dft}"
