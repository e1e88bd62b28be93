"""Building on the meta device (cat.models.on_meta): the skeleton torch's meta device builds (the FLOPs tables run
it), its initialisation skipped, and real tensors made there left alone."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.models import model_entrypoint

from cat.models import on_meta
from tests.conftest import QUICK_MODELS, quick_few

OURS = sorted(n for n in timm.list_models() if model_entrypoint(n).__module__.startswith("cat."))


def _skeleton(model: torch.nn.Module) -> list[tuple]:
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return [(name, t.shape, t.dtype, t.requires_grad, t.device.type, type(t).__name__) for name, t in tensors]


@pytest.mark.parametrize("name", [*quick_few(OURS, QUICK_MODELS), "deit_tiny_patch16_224", "resnet18"])
def test_on_meta_builds_the_skeleton_torchs_meta_device_builds(name):
    with torch.device("meta"):
        expected = timm.create_model(name)
    with on_meta():
        built = timm.create_model(name)
    assert _skeleton(built) == _skeleton(expected)


def test_on_meta_skips_the_fills_of_meta_tensors_only():
    with on_meta():
        meta = torch.empty(3)
        assert meta.mul_(2) is meta and meta.is_meta
        real = torch.ones(3, device="cpu")
        real.mul_(2).add_(1)
        torch.nn.init.trunc_normal_(weights := torch.zeros(1000, device="cpu"), std=0.02)
    assert real.tolist() == [3.0, 3.0, 3.0]
    assert 0.015 < weights.std().item() < 0.025
