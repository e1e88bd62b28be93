"""One exported program for every batch size and resolution: torch.export and ONNX (the FFTs as
ONNX ``DFT``), for cat's models and any timm model.

    program = cat.export.export_program(model, torch.randn(2, 3, 224, 224))
    onnx_model = cat.export.export_onnx(model, torch.randn(2, 3, 224, 224), "model.onnx")

Height and width are exported as multiples of the model's output stride (its last feature map's
reduction), at least twice it: a dimension of size 1 broadcasts differently, so an example's
grids of 2 or more make the program valid for every grid of 2 or more.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from cat.runtime.io import atomic_write_bytes

__all__ = [
    "output_stride",
    "takes_any_size",
    "image_shapes",
    "evaluating",
    "export_program",
    "export_onnx",
    "program_to_onnx",
]


def output_stride(model: nn.Module) -> int:
    """The reduction of the model's last feature map (32 where it declares none)."""
    feature_info = getattr(model, "feature_info", None)
    return feature_info[-1]["reduction"] if feature_info else 32


def takes_any_size(model: nn.Module) -> bool:
    """False for a model built for one input size: timm's patch embedding with ``strict_img_size``
    (its ViTs and Swins unless ``dynamic_img_size=True``), converted to circulant attention or not."""
    return not getattr(getattr(model, "patch_embed", None), "strict_img_size", False)


def image_shapes(model: nn.Module, max_side: int = 4096, dynamic_size: bool = True) -> tuple[dict[int, Any]]:
    """``dynamic_shapes`` for a model's one image argument (B, C, H, W): any batch, and (with
    ``dynamic_size``) H and W any multiple of the output stride from twice it to ``max_side``."""
    batch = torch.export.Dim("batch", min=1, max=1024)
    if not dynamic_size:
        return ({0: batch},)
    stride = output_stride(model)
    height, width = (torch.export.Dim(side, min=2, max=max_side // stride) for side in ("height", "width"))
    return ({0: batch, 2: stride * height, 3: stride * width},)


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode, then every module back in the mode it had (a model exported mid-training, or
    with some modules kept in eval mode, trains on as it did)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


def export_program(model: nn.Module, example: Tensor, dynamic_size: bool = True) -> torch.export.ExportedProgram:
    """``torch.export.export`` of ``model`` in eval mode (:func:`evaluating`) with :func:`image_shapes`;
    ``example``'s sides must be multiples of the output stride, at least twice it."""
    with evaluating(model):
        return torch.export.export(model, (example,), dynamic_shapes=image_shapes(model, dynamic_size=dynamic_size))


def export_onnx(
    model: nn.Module,
    example: Tensor,
    path: str | os.PathLike[str] | None = None,
    opset: int = 20,
    dynamic_size: bool = True,
) -> Any:
    """The ONNX model (an ``onnx.ModelProto``; written to ``path`` if given) of :func:`export_program`:
    :func:`program_to_onnx` of it."""
    return program_to_onnx(export_program(model, example, dynamic_size=dynamic_size), path, opset)


def program_to_onnx(
    program: torch.export.ExportedProgram, path: str | os.PathLike[str] | None = None, opset: int = 20
) -> Any:
    """The ONNX model (an ``onnx.ModelProto``; written to ``path`` if given) of an exported program, by
    torch's default exporter (needs ``onnxscript``): circulant attention's FFTs become ``DFT`` nodes.
    A caller that also wants the program exports once and converts it (export is the slow part).

    The exporter annotates the outputs of the inverse real DFTs with the one-sided length where the
    two-sided one is meant; onnxruntime plans buffers from such annotations and fails at any other
    resolution than the example's. The intermediate shape annotations are therefore dropped: the
    runtime infers them from the graph when it loads it.
    """
    onnx_program = torch.onnx.export(program, dynamo=True, opset_version=opset, verbose=False, optimize=True)
    assert onnx_program is not None  # the dynamo exporter returns its program
    proto = onnx_program.model_proto
    del proto.graph.value_info[:]
    if path is not None:
        atomic_write_bytes(os.fspath(path), proto.SerializeToString())
    return proto
