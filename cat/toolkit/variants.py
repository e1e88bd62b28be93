"""Models the speed tools compare, named ``MODEL[+VARIANT]`` on their command lines, and one training step of each.

Variants: ``+lean`` and ``+stored`` (circulant attention's backward from its input alone, or from kept spectra:
:func:`cat.ops.set_lean_attention`), ``+released`` (the released CA-DeiT pipeline written literally),
``+checkpointed`` (timm's activation checkpointing), ``+converted`` (:func:`cat.convert` of a softmax model),
``+matmul`` (a softmax model's attention written as matrix products and a softmax, as timm computes it with
``TIMM_FUSED_ATTN=0``: the paper's baseline), ``+separable`` and ``+fft`` (circulant attention's DFTs as GEMMs, or
as torch.fft in float32, whatever ``auto`` would take), ``+triton`` and ``+aten`` (circulant attention as the Triton
kernels, or as ATen's operators, whatever ``auto`` would take).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import timm
import torch
import torch.nn.functional as F
from timm.utils.model import reparameterize_model

import cat
from cat.classification.optimization import step_kwargs
from cat.errors import ConfigError
from cat.ops import CirculantAttention, set_attention_kernel, set_fft_backend, set_lean_attention
from cat.ops.reference import released_circulant_attention

__all__ = ["VARIANTS", "split_variant", "build_variant", "inference_variant", "train_step_fns"]

VARIANTS = (
    "",
    "lean",
    "stored",
    "released",
    "checkpointed",
    "converted",
    "matmul",
    "separable",
    "fft",
    "triton",
    "aten",
)


def split_variant(spec: str) -> tuple[str, str]:
    """``MODEL[+VARIANT]`` as (model, variant); a ConfigError for a variant the tools do not know."""
    name, _, variant = spec.partition("+")
    if variant not in VARIANTS:
        raise ConfigError(f"unknown model variant +{variant} in {spec!r} (known: {', '.join(VARIANTS[1:])})")
    return name, variant


def build_variant(spec: str, res: int, device: str | torch.device, model_args: dict[str, Any]) -> Any:
    """The model ``MODEL[+VARIANT]`` at ``res`` with ``model_args``, in training mode, seeded alike."""
    name, variant = split_variant(spec)
    torch.manual_seed(0)
    with torch.device(device):
        model: Any = timm.create_model(name, img_size=res, **model_args).train()  # timm's model API
    if variant == "converted":
        cat.convert(model)
    if variant in ("lean", "stored"):
        set_lean_attention(model, variant == "lean")
    if variant in ("separable", "fft"):
        set_fft_backend(model, "separable" if variant == "separable" else "fft")
    if variant in ("triton", "aten"):
        set_attention_kernel(model, "triton" if variant == "triton" else "aten")
    model.set_grad_checkpointing(variant == "checkpointed")
    if variant == "released":
        for module in model.modules():
            if isinstance(module, CirculantAttention):
                module.forward = functools.partial(released_circulant_attention, module)  # type: ignore[method-assign]
    if variant == "matmul":
        softmax = [m for m in model.modules() if hasattr(m, "fused_attn")]
        if not softmax:
            raise ConfigError(f"{spec}: {name} has no softmax attention to write as matrix products")
        for module in softmax:
            module.fused_attn = False
    return model


def inference_variant(spec: str, res: int, device: str | torch.device, model_args: dict[str, Any]) -> Any:
    """:func:`build_variant`'s model as inference runs it: in eval mode, reparameterized
    (``timm.utils.reparameterize_model``: circulant blocks add their convolution's centre tap and join their
    projections' weights once) but for ``+released``, which reads the released parameters by name."""
    model = build_variant(spec, res, device, model_args).eval()
    return model if split_variant(spec)[1] == "released" else reparameterize_model(model, inplace=True)


def train_step_fns(
    models: list[str],
    res: int,
    batch: int,
    device: str | torch.device,
    compiled: bool,
    model_args: dict[str, Any],
    autocast: Callable[[], Any] | None = None,
    compile_mode: str = "default",
) -> dict[str, Callable[..., None]]:
    """A whole training step (forward, cross-entropy, backward, AdamW) of each model on one random batch, under
    ``autocast()`` if given; with ``compiled`` through ``torch.compile(model, mode=compile_mode)`` (as ``compile=true``
    trains), compiled here in three steps (CUDA graphs record on the third). A step called with ``optimize=False``
    leaves out the optimizer's."""
    x = torch.randn(batch, 3, res, res, device=device)
    fns = {}
    for spec in models:
        model: Any = build_variant(spec, res, device, model_args)  # timm's: num_classes
        forward = torch.compile(model, mode=compile_mode) if compiled else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **step_kwargs("adamw", torch.device(device), {}))
        target = torch.randint(0, model.num_classes, (batch,), device=device)

        def step(optimize: bool = True, forward=forward, optimizer=optimizer, target=target) -> None:
            optimizer.zero_grad(set_to_none=True)
            if autocast is None:
                loss = F.cross_entropy(forward(x), target)
            else:
                with autocast():
                    loss = F.cross_entropy(forward(x).float(), target)
            loss.backward()
            if optimize:
                optimizer.step()

        for _ in range(3 if compiled else 0):  # not in the timings: the forward's and the backward's compilation
            step()
        fns[spec] = step
    return fns
