"""Multiply-accumulate counts the way the paper reports them (fvcore-style GMACs, called FLOPs).

Matrix products, linear layers, convolutions and the attention products of softmax attention
(also inside ``scaled_dot_product_attention``) are counted by torch's ``FlopCounterMode``;
circulant attention adds the paper's formula (:func:`cat.ops.circulant_attention_flops`), and
its FFTs are not counted a second time. Element-wise ops and norms are not counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from cat.errors import ConfigError, UserError
from cat.export import evaluating
from cat.ops import CirculantAttention, circulant_attention_flops

__all__ = ["count_macs", "model_cost"]


def _cpu_sdpa_flops(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


# torch's counter knows the CUDA SDPA kernels; on CPU the fused kernel has its own op.
_EXTRA_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}


def count_macs(model: nn.Module, inputs: Tensor, forward: Callable[[Tensor], Any] | None = None) -> int:
    """Multiply-accumulates of one forward of ``model`` on ``inputs`` (any device, meta included), in eval mode
    (:func:`cat.export.evaluating`): a model counted mid-training keeps its BatchNorm statistics and its modes.

    ``forward`` replaces ``model(inputs)`` for models driven another way (detectors, segmentors).
    """
    circulant_macs = 0

    def add_circulant(module: CirculantAttention, args: tuple[Any, ...], output: Tensor) -> None:
        nonlocal circulant_macs
        x, _ = args
        circulant_macs += x.shape[0] * circulant_attention_flops(x.shape[1], module.dim, module.head_dim)

    hooks = [m.register_forward_hook(add_circulant) for m in model.modules() if isinstance(m, CirculantAttention)]
    try:
        with (
            torch.no_grad(),
            evaluating(model),
            FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS) as counter,
        ):
            (forward or model)(inputs)
    finally:
        for h in hooks:
            h.remove()
    return counter.get_total_flops() // 2 + circulant_macs


def model_cost(name: str, img_size: tuple[int, int], **kwargs: Any) -> tuple[int, int]:
    """(parameters, MACs of one forward at ``img_size``) of the timm model ``name``, built on the meta
    device: no memory, no weights, no compute."""
    import cat
    from cat.models import model_arguments, on_meta

    accepted = model_arguments(name)
    if accepted is None or "img_size" in accepted:  # models without it (e.g. convnets) take any size
        kwargs = {"img_size": img_size, **kwargs}
    try:
        with on_meta():
            model = cat.create_model(name, **kwargs).eval()
        with torch.device("meta"):
            return sum(p.numel() for p in model.parameters()), count_macs(model, torch.empty(1, 3, *img_size))
    except UserError:
        raise
    except Exception as error:  # the model's own complaint about the input size or its arguments
        reason = str(error).strip().splitlines()[0]
        raise ConfigError(f"{name} does not run at {img_size[0]}x{img_size[1]}: {reason}") from None
