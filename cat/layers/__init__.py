"""Building blocks shared by the CA model families."""
from .block import CirculantBlock, LayerNorm6

__all__ = ["CirculantBlock", "LayerNorm6"]
