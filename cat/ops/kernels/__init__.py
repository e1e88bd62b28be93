"""Circulant attention as one kernel each way (Triton): :mod:`.forward`, :mod:`.backward`, the DFT tiles they share
(:mod:`.tiles`) and the operators that launch them (:mod:`.launch`)."""

from .launch import circulant_kernel, circulant_kernel_qkv, covers

__all__ = ["circulant_kernel", "circulant_kernel_qkv", "covers"]
