"""cat: Circulant Attention for vision transformers (Han et al., AAAI 2026, arXiv 2512.21542)."""

from . import models, ops
from .models import convert, create_model, load_checkpoint, load_state_dict

__all__ = ["convert", "create_model", "load_checkpoint", "load_state_dict", "models", "ops"]
__version__ = "0.2.0"
