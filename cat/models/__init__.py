"""Model families (registered in timm on import), their creation and safe checkpoint loading."""

from . import cat_transformer, deit, pvt, swin  # noqa: F401  (register the model families with timm)
from .convert import convert
from .deit import CirculantVisionTransformer
from .factory import (
    backbone_state_dict,
    cat_model_names,
    create_model,
    load_backbone_checkpoint,
    load_checkpoint,
    load_weights,
    model_arguments,
    model_kwargs,
    on_meta,
    parse_model_args,
)
from .loading import (
    CheckpointMismatchError,
    LoadReport,
    UnsafeCheckpointError,
    adapt_state_dict,
    check_name_hash,
    extract_state_dict,
    holds_ema_weights,
    load_checkpoint_file,
    load_state_dict,
)

__all__ = [
    "convert",
    "cat_model_names",
    "create_model",
    "on_meta",
    "model_arguments",
    "model_kwargs",
    "parse_model_args",
    "load_checkpoint",
    "load_weights",
    "load_backbone_checkpoint",
    "backbone_state_dict",
    "adapt_state_dict",
    "CirculantVisionTransformer",
    "CheckpointMismatchError",
    "LoadReport",
    "UnsafeCheckpointError",
    "check_name_hash",
    "load_checkpoint_file",
    "extract_state_dict",
    "holds_ema_weights",
    "load_state_dict",
]
