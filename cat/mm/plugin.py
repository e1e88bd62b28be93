"""What ``import cat.mm`` does where the OpenMMLab stack is installed, so that a config's one line
``custom_imports = dict(imports=['cat.mm'])`` gives mmdet's and mmseg's own tools everything cat's configs name:
``TimmBackbone`` in the mmdet and mmseg model registries; cat's loops, samplers, hooks and metric backend in
mmengine's (which both look up); the atomic checkpoint file backend; cat's safe checkpoint loading for every
mmengine loader; and counting handles for circulant attention and SDPA in mmengine's FLOP analysis. Each step
replaces what an earlier one registered: importing again, or calling :func:`register`, changes nothing."""

from __future__ import annotations

from .analysis import register_flop_handles
from .backbone import register_backbones
from .metric_sink import MetricSinkBackend
from .portable import PortableCheckpointHook, RunConfigHook
from .preemption import (
    PreemptionHook,
    ResumableDefaultSampler,
    ResumableEpochBasedTrainLoop,
    ResumableInfiniteSampler,
    ResumableIterBasedTrainLoop,
)
from .safe_load import install_safe_checkpoint_io

__all__ = ["REGISTERED_AS_DEFINED", "register"]

# The classes mmengine's registries hold from their definition on (their modules register them as they run).
REGISTERED_AS_DEFINED = (
    MetricSinkBackend,
    PortableCheckpointHook,
    PreemptionHook,
    RunConfigHook,
    ResumableDefaultSampler,
    ResumableEpochBasedTrainLoop,
    ResumableInfiniteSampler,
    ResumableIterBasedTrainLoop,
)


def register() -> None:
    """Register cat's OpenMMLab components and install its checkpoint loading (idempotent)."""
    register_backbones()
    install_safe_checkpoint_io()
    register_flop_handles()
