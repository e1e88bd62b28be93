"""cat's hierarchical models as OpenMMLab backbones (mmdet and mmseg), without a second copy.

``TimmBackbone`` wraps any timm-registered model with ``forward_intermediates`` (CA-PVT, PVT,
CA-Swin, Swin, CAT): it builds the classification model itself, so ImageNet checkpoints from
``train_cls.py`` or the release format load key for key, and returns the stage outputs as NCHW
maps at strides 4/8/16/32 with an optional LayerNorm per output (as Swin/PVT detection backbones do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmengine.logging import print_log
from mmengine.model import BaseModule
from torch import Tensor, nn

import cat
from cat.models import backbone_state_dict, load_backbone_checkpoint, on_meta
from cat.ops import BackendPolicy, KernelPolicy, LeanPolicy, configure_attention

from .fetch import local_checkpoint

__all__ = ["TimmBackbone", "register_backbones", "backbone_features", "check_pretrained"]


class TimmBackbone(BaseModule):
    """A cat/timm hierarchical model as a multi-scale backbone.

    Args:
        model_name: a timm model name (``ca_pvt_tiny``, ``ca_swin_tiny``, ``cat_small``, ``pvt_tiny``...).
        out_indices: which stages to return (0-3, strides 4/8/16/32).
        out_norm: add a LayerNorm on each returned map.
        pretrained: an ImageNet checkpoint (release format, bare state dict or cat's), a path or a URL (fetched as
            mmengine fetches one, into torch's hub cache, and read by the safe loader); the classifier is dropped and
            position tables resized; the log says how many of the backbone's tensors it gave, and what did not load.
            A detector's or segmentor's checkpoint is refused, naming ``init_cfg``'s ``prefix='backbone.'``.
        strict_pretrained: every weight of the backbone must come from ``pretrained`` (at its shape),
            else :class:`cat.models.CheckpointMismatchError` names the file and the keys.
        model_kwargs: passed to the model factory (``drop_path_rate``, ``attn_pattern``, ...).
        lean_attention: what circulant attention keeps for its backward: its spectra (``False``: faster steps),
            only its input (``True``: the least memory), or by device and memory (``'auto'``;
            :func:`cat.ops.set_lean_attention`).
        fft_backend: how circulant attention's DFTs run (:func:`cat.ops.set_fft_backend`).
        attention_kernel: whether it runs as Triton kernels (:func:`cat.ops.set_attention_kernel`).
        attention_memory_mb: circulant attention's memory budget in MiB (:func:`cat.ops.set_attention_memory`;
            None: a share of the device's free memory).
        grad_checkpointing: recompute each block's activations in the backward (timm's
            ``set_grad_checkpointing``): less memory, slower steps.
        init_cfg: mmengine's; OpenMMLab's usual ``dict(type='Pretrained', checkpoint=...)`` without a ``prefix``
            (an ImageNet checkpoint of the classification model) is read as ``pretrained``: mmengine would load it
            into this wrapper, whose keys sit under ``model.``, and match nothing. With a ``prefix`` (the backbone
            of a detector's or segmentor's checkpoint, ``prefix='backbone.'``) the keys are this module's own, and
            mmengine loads it as it does for any backbone.
    """

    def __init__(
        self,
        model_name: str,
        out_indices: Sequence[int] = (0, 1, 2, 3),
        out_norm: bool = True,
        pretrained: str | None = None,
        strict_pretrained: bool = False,
        model_kwargs: dict[str, Any] | None = None,
        lean_attention: LeanPolicy = "auto",
        fft_backend: BackendPolicy = "auto",
        attention_memory_mb: int | None = None,
        attention_kernel: KernelPolicy = "auto",
        grad_checkpointing: bool = False,
        init_cfg: dict | None = None,
    ) -> None:
        init_cfg, pretrained = _pretrained_from_init_cfg(init_cfg, pretrained)
        super().__init__(init_cfg=init_cfg)
        # A timm model: its feature API (feature_info, forward_intermediates, pruning) is timm's, not nn.Module's.
        model: Any = cat.create_model(model_name, num_classes=0, **(model_kwargs or {}))
        self.model: Any = configure_attention(model, lean_attention, fft_backend, attention_memory_mb, attention_kernel)
        if grad_checkpointing:
            model.set_grad_checkpointing(True)
        self.out_indices = tuple(out_indices)
        # The classifier's final norm feeds nothing here; DDP rejects parameters without gradients.
        whole = model.state_dict().keys()
        model.prune_intermediate_layers(list(self.out_indices), prune_norm=True, prune_head=True)
        self.pruned = sorted(whole - model.state_dict().keys())  # a classification checkpoint's, unused here
        # A feature extractor has no classes: mmdet's NumClassCheckHook holds every module with the attribute to
        # the dataset's class count (timm's models keep num_classes=0).
        del model.num_classes
        self.pretrained, self.strict_pretrained = pretrained, strict_pretrained
        channels = [model.feature_info[i]["num_chs"] for i in self.out_indices]
        self.norms = nn.ModuleList(nn.LayerNorm(c) for c in channels) if out_norm else None

    def init_weights(self) -> None:
        super().init_weights()
        if self.pretrained:
            report = load_backbone_checkpoint(
                self.model, local_checkpoint(self.pretrained), self.strict_pretrained, self.pruned
            )
            total = len(self.model.state_dict())
            loaded = total - len(report.missing) - len(report.shape_mismatch)
            print_log(
                f"{type(self).__name__} {self.model.pretrained_cfg['architecture']}: loaded {loaded}/{total} of its "
                f"tensors from {self.pretrained} ({len(report.missing)} missing there, {len(report.shape_mismatch)} "
                f"of another shape, {len(report.unexpected)} of the file's unused besides its classifier and what "
                "the backbone leaves out)",
                logger="current",
            )

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        feats = self.model.forward_intermediates(x, indices=list(self.out_indices), intermediates_only=True)
        if self.norms is not None:
            feats = [
                norm(f.permute(0, 2, 3, 1)).permute(0, 3, 1, 2).contiguous()
                for norm, f in zip(self.norms, feats, strict=True)
            ]
        return tuple(feats)


def _pretrained_from_init_cfg(init_cfg: Any, pretrained: str | None) -> tuple[Any, str | None]:
    """``(init_cfg, pretrained)`` with a prefix-less ``Pretrained`` entry of ``init_cfg`` moved to ``pretrained``."""
    entries = init_cfg if isinstance(init_cfg, list) else [init_cfg] if init_cfg is not None else []
    moved = [e for e in entries if isinstance(e, dict) and e.get("type") == "Pretrained" and not e.get("prefix")]
    if not moved:
        return init_cfg, pretrained
    if len(moved) > 1 or pretrained is not None:
        raise ValueError(
            "TimmBackbone: give the ImageNet checkpoint once, as pretrained=... or as init_cfg=dict(type='Pretrained', "
            f"checkpoint=...), not both (got pretrained={pretrained!r} and {len(moved)} init_cfg Pretrained entries)"
        )
    checkpoint = moved[0].get("checkpoint")
    if not isinstance(checkpoint, str) or not checkpoint:
        raise ValueError(f"TimmBackbone: init_cfg {moved[0]!r} names no checkpoint file")
    rest = [e for e in entries if e is not moved[0]]
    return (rest if isinstance(init_cfg, list) else None) or None, checkpoint


def check_pretrained(model: nn.Module) -> None:
    """Read now the ``pretrained`` weights of each backbone of ``model``: mmengine reads them in ``init_weights``,
    after it has built the datasets (a minute on COCO), so a hostile or unreadable file, or with
    ``strict_pretrained`` a file of another model, is refused before that. A strict backbone is loaded (the
    check is the load); ``init_weights`` loads it again over its initialisation, and since every weight comes
    from the file the result is the same. A lenient one is only read: what does not fit is reported when it loads."""
    for module in model.modules():
        if isinstance(module, TimmBackbone) and module.pretrained:
            path = local_checkpoint(module.pretrained)
            if module.strict_pretrained:
                load_backbone_checkpoint(module.model, path, True, module.pruned)
            else:
                backbone_state_dict(module.model, path)


# backbone_features' answers by model and arguments: a job's config check and its config building both ask.
_FEATURES: dict[str, list[dict[str, Any]]] = {}


def backbone_features(model_name: str, **model_kwargs: Any) -> list[dict[str, Any]]:
    """The model's feature levels, timm's ``feature_info``: ``num_chs`` and ``reduction`` (the stride) of each
    map ``forward_intermediates`` can return (built on the meta device: no memory, no weights)."""
    key = repr((model_name, sorted(model_kwargs.items())))
    if key not in _FEATURES:
        with on_meta():
            model: Any = cat.create_model(model_name, num_classes=0, **model_kwargs)  # timm's feature_info
        _FEATURES[key] = [dict(level) for level in model.feature_info]
    return [dict(level) for level in _FEATURES[key]]


def register_backbones() -> None:
    """Register ``TimmBackbone`` in the mmdet and mmseg registries that are installed (idempotent)."""
    registries = []
    try:
        from mmdet.registry import MODELS as det_models

        registries.append(det_models)
    except ImportError:
        pass
    try:
        from mmseg.registry import MODELS as seg_models

        registries.append(seg_models)
    except ImportError:
        pass
    for registry in registries:
        registry.register_module(name="TimmBackbone", module=TimmBackbone, force=True)
