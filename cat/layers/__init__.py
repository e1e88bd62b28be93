"""Building blocks shared by the CA model families."""

from .attention import TokenReweightedAttention
from .block import CirculantBlock, CirculantBlockNHWC, LayerNorm6, init_vit_weights
from .pattern import parse_attn_pattern

__all__ = [
    "CirculantBlock",
    "CirculantBlockNHWC",
    "LayerNorm6",
    "init_vit_weights",
    "parse_attn_pattern",
    "TokenReweightedAttention",
]
