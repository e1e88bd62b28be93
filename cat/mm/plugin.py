"""What ``import cat.mm`` does where the OpenMMLab stack is installed, so that a config's one line
``custom_imports = dict(imports=['cat.mm'])`` gives mmdet's and mmseg's own tools everything cat's configs name:
``TimmBackbone`` in the mmdet and mmseg model registries; cat's loops, samplers, hooks and metric backend in
mmengine's (which both look up); the atomic checkpoint file backend; and counting handles for circulant attention
and SDPA in mmengine's FLOP analysis. It adds names and changes nothing of the stack's own: mmengine's checkpoint
loaders stay its own (cat's runs install cat's safe loading for themselves, :func:`cat.mm.safe_load.
install_safe_checkpoint_io`), and torch's weights-only allow-list and the environment are as the stack's own imports
leave them. Each step replaces what an earlier one registered: importing again, or calling :func:`register`, changes
nothing."""

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
from .safe_load import register_atomic_backend

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
    """Register cat's OpenMMLab components (idempotent)."""
    register_backbones()
    register_atomic_backend()
    register_flop_handles()
