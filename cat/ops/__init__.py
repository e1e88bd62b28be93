"""The circulant-attention operator. Pure torch: imports nothing else from ``cat``."""

from .circulant import (
    CirculantAttention,
    bccb_project,
    circulant_attention,
    circulant_attention_flops,
    configure_attention,
    set_attention_kernel,
    set_attention_memory,
    set_fft_backend,
    set_lean_attention,
)
from .policy import BackendPolicy, KernelPolicy, LeanPolicy, describe
from .spectral import attend_spectra

__all__ = [
    "BackendPolicy",
    "KernelPolicy",
    "LeanPolicy",
    "circulant_attention",
    "attend_spectra",
    "CirculantAttention",
    "bccb_project",
    "circulant_attention_flops",
    "configure_attention",
    "describe",
    "set_attention_kernel",
    "set_attention_memory",
    "set_fft_backend",
    "set_lean_attention",
]
