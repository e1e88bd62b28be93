"""The OpenMMLab bridge shared by detection and segmentation: cat backbones in the mmdet/mmseg
registries, the Hydra -> mmengine config, safe checkpoint loading and CPU-distributed fixes."""

from .backbone import TimmBackbone, backbone_channels, register_backbones
from .runner import run_mm

__all__ = ["TimmBackbone", "backbone_channels", "register_backbones", "run_mm"]
