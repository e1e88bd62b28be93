"""FLOPs of whole detectors and segmentors, counted like ``cat.flops.count_macs`` counts models."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig

from cat.flops import count_macs

from .backbone import register_backbones
from .config import base_with_backbone

__all__ = ["detector_macs", "segmentor_macs"]


def _build(cfg: DictConfig, registry: Any) -> torch.nn.Module:
    register_backbones()
    return registry.build(base_with_backbone(cfg.model).model).eval()


def detector_macs(cfg: DictConfig, hw: tuple[int, int], proposals: int = 1000) -> tuple[int, int]:
    """(params, MACs) of a two-stage detector: backbone, neck, RPN head and RoI heads on a fixed
    ``proposals`` boxes (the test-time RPN output size), so the count does not depend on the data."""
    from mmdet.registry import MODELS
    from mmdet.structures import DetDataSample
    from mmdet.utils import register_all_modules
    from mmengine.structures import InstanceData

    register_all_modules()
    model = _build(cfg, MODELS)
    h, w = hw
    boxes = torch.rand(proposals, 4) * torch.tensor([w / 2, h / 2, w / 2, h / 2])
    boxes[:, 2:] += boxes[:, :2] + 16
    sample = DetDataSample(metainfo={"img_shape": hw, "batch_input_shape": hw})

    def forward(images: torch.Tensor) -> Any:
        feats = model.extract_feat(images)
        model.rpn_head(feats)
        return model.roi_head.forward(feats, [InstanceData(bboxes=boxes)], [sample])

    with torch.no_grad():
        macs = count_macs(model, torch.randn(1, 3, h, w), forward)
    return sum(p.numel() for p in model.parameters()), macs


def segmentor_macs(cfg: DictConfig, hw: tuple[int, int]) -> tuple[int, int]:
    """(params, MACs) of an encoder-decoder segmentor's inference forward (auxiliary head excluded)."""
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules

    register_all_modules()
    model = _build(cfg, MODELS)
    params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("auxiliary_head"))
    with torch.no_grad():
        macs = count_macs(model, torch.randn(1, 3, *hw), lambda x: model.decode_head(model.extract_feat(x)))
    return params, macs
