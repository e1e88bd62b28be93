"""The circulant-attention operator. Pure torch: imports nothing else from ``cat``."""

from .circulant import (
    LEAN_AUTO_MIN_FLOATS,
    CirculantAttention,
    LeanPolicy,
    attend_spectra,
    bccb_project,
    circulant_attention,
    circulant_attention_flops,
    set_fft_backend,
    set_lean_attention,
)

__all__ = [
    "LEAN_AUTO_MIN_FLOATS",
    "LeanPolicy",
    "circulant_attention",
    "attend_spectra",
    "CirculantAttention",
    "bccb_project",
    "circulant_attention_flops",
    "set_fft_backend",
    "set_lean_attention",
]
