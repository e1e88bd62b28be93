"""cat: Circulant Attention for vision transformers (Han et al., AAAI 2026, arXiv 2512.21542)."""

from . import models, ops
from .models import create_model, load_checkpoint

__all__ = ["create_model", "load_checkpoint", "models", "ops"]
__version__ = "0.2.0"
