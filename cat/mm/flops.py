"""FLOPs of whole detectors and segmentors, counted like ``cat.flops.count_macs`` counts models.

Both are built and run on the meta device by default (no weights, no compute: a count is shapes
only; ``device="cpu"`` runs the real forward, and the two agree exactly, which a test checks). Two
data-dependent steps of a two-stage detector are made shape-only there, neither changes a count:
RoIAlign runs as torchvision's op (mmcv's has no meta kernel; neither is counted), and the RoI
extractor's per-level ``nonzero`` treats every box as on every level (each level's RoIAlign writes
the same (proposals, C, 7, 7) buffer the heads read).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx.experimental._config as fx_config

from cat.flops import count_macs
from cat.models import on_meta

from .config import base_with_backbone
from .schema import MMModelConfig

__all__ = ["detector_macs", "segmentor_macs"]


def _roi_align_on_torchvision(node: Any) -> None:
    if isinstance(node, dict):
        if node.get("type") == "RoIAlign":
            node["use_torchvision"] = True
        for value in node.values():
            _roi_align_on_torchvision(value)
    elif isinstance(node, list):
        for value in node:
            _roi_align_on_torchvision(value)


def _build(model: MMModelConfig, registry: Any, device: str) -> Any:
    """The model (an mmdet detector or mmseg segmentor: its parts are its registry's, untyped) in eval mode."""
    model_cfg = base_with_backbone(model).model
    _roi_align_on_torchvision(model_cfg)
    with on_meta() if device == "meta" else torch.device(device):
        return registry.build(model_cfg).eval()


def detector_macs(
    model_cfg: MMModelConfig, hw: tuple[int, int], proposals: int = 1000, device: str = "meta"
) -> tuple[int, int]:
    """(params, MACs) of a two-stage detector: backbone, neck, RPN head and RoI heads on a fixed
    ``proposals`` boxes (the test-time RPN output size), so the count does not depend on the data."""
    from mmdet.registry import MODELS
    from mmdet.structures import DetDataSample
    from mmdet.utils import register_all_modules
    from mmengine.structures import InstanceData

    register_all_modules()
    model = _build(model_cfg, MODELS, device)
    sample = DetDataSample(metainfo={"img_shape": hw, "batch_input_shape": hw})
    h, w = hw
    corners = torch.rand(proposals, 2, device=device) * torch.tensor([w / 2, h / 2], device=device)
    boxes = InstanceData(bboxes=torch.cat([corners, corners + 16], dim=1))

    def forward(images: torch.Tensor) -> Any:
        feats = model.extract_feat(images)
        model.rpn_head(feats)
        return model.roi_head.forward(feats, [boxes], [sample])

    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):  # type: ignore[attr-defined]  # torch's config module
        macs = count_macs(model, torch.rand(1, 3, *hw, device=device), forward)
    return sum(p.numel() for p in model.parameters()), macs


def segmentor_macs(model_cfg: MMModelConfig, hw: tuple[int, int], device: str = "meta") -> tuple[int, int]:
    """(params, MACs) of an encoder-decoder segmentor's inference forward (auxiliary head excluded)."""
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules

    register_all_modules()
    model = _build(model_cfg, MODELS, device)
    params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("auxiliary_head"))
    macs = count_macs(model, torch.rand(1, 3, *hw, device=device), lambda x: model.decode_head(model.extract_feat(x)))
    return params, macs
