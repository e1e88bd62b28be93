"""What a classification run measures as it trains: the step meter (time, data wait, memory, FLOP rate) and the
profiler's window."""

from __future__ import annotations

import logging

import torch
from torch import nn

from cat.data import FORMATS, file_format
from cat.flops import count_macs
from cat.runtime import DistEnv, resolve_amp
from cat.runtime.hardware import compute_dtype, peak_tflops
from cat.runtime.logger import RUN_LOGGER
from cat.runtime.meter import StepMeter
from cat.runtime.profiling import ProfileWindow

from .schema import ClsConfig

__all__ = ["build_step_meter", "build_profile_window"]


def build_step_meter(cfg: ClsConfig, env: DistEnv, model: nn.Module) -> StepMeter:
    """The meter of a training run's interval lines: the model's training FLOPs per image (3 x one forward's,
    counted at the input size) and the device's peak for the run's dtype, where one is listed."""
    log = logging.getLogger(RUN_LOGGER)
    try:
        flops: float | None = 6.0 * count_macs(model, torch.zeros(1, 3, *cfg.input_size(), device=env.device))
    except Exception as error:  # a model the counter cannot follow: no FLOP rate rather than a wrong one
        log.info("no FLOP rate in the log: counting %s's FLOPs failed (%s)", cfg.model.name, error)
        flops = None
    enabled, amp_name, _ = resolve_amp(cfg.amp, env.device)
    dtype = compute_dtype(env.device, amp_name if enabled else None)
    peak = peak_tflops(env.device, dtype)
    if peak is None and env.is_main:
        where = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "a CPU"
        log.info("mfu is null: no listed %s peak for %s (cat.runtime.hardware.PEAK_TFLOPS)", dtype, where)
    advice = [f"more loader processes per training process (workers={cfg.workers} now, up to its CPU cores)"]
    spec = file_format(cfg.data)
    if spec is not None and not spec.packed:
        packed = " or ".join(name for name, f in FORMATS.items() if f.packed)
        advice.append(f"a packed format (data.format={packed}, tools/pack_dataset.py)")
    if spec is not None:  # image files: the opt-in decoding options
        advice.append(
            "less decoding (data.decode_draft=true, data.normalize_on_device=true, or tools/pack_dataset.py --max-side)"
        )
    advice_text = f"Try {'; '.join(advice)}; tools/bench_data.py measures the loader alone."
    return StepMeter(env.device, flops, peak, advice_text)


def build_profile_window(cfg: ClsConfig, env: DistEnv, run_folder: str, total_steps: int) -> ProfileWindow | None:
    """``profile.steps`` of rank 0 (None when off, or on other ranks); a window past the run's ``total_steps``
    says so in the log at the start, rather than record nothing without a word."""
    if cfg.profile.steps is None or not env.is_main:
        return None
    first, last = cfg.profile.steps
    if first > total_steps:
        logging.getLogger(RUN_LOGGER).warning(
            "profile.steps=[%d, %d]: this run has %d steps, so nothing will be profiled", first, last, total_steps
        )
    return ProfileWindow(first, last, run_folder, env.device, env.rank, logging.getLogger(RUN_LOGGER), cfg.profile.top)
