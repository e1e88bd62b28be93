"""What every cat model family shares: timm's model API, the pretrained config, the builder, and
gradient checkpointing of blocks that take the token grid.

No ``from __future__ import annotations`` here: FX copies the root ``forward``'s annotation into
the code it generates, and TorchScript cannot read a string one (timm's FX -> TorchScript path)."""

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, checkpoint_seq
from timm.models._features import feature_take_indices
from torch import Tensor, nn

from cat.layers import init_vit_weights

__all__ = ["TimmApiMixin", "family_cfg", "build_family_model", "checkpoint_blocks"]

Model = TypeVar("Model", bound=nn.Module)


def family_cfg(first_conv: str, classifier: str = "head", **kwargs: Any) -> dict[str, Any]:
    """A pretrained config with ImageNet-1K defaults; ``url``/``file`` where released weights exist
    (CA-DeiT), else local files through ``cat.create_model(checkpoint=...)``."""
    return {
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": None,
        "crop_pct": 0.875,
        "interpolation": "bicubic",
        "fixed_input_size": False,
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": first_conv,
        "classifier": classifier,
        "license": "apache-2.0",
        **kwargs,
    }


def build_family_model(
    cls: type[Model],
    variant: str,
    pretrained: bool,
    default_out_indices: int | Sequence[int] = (0, 1, 2, 3),
    **kwargs: Any,
) -> Model:
    """``timm.build_model_with_cfg`` for a cat family; ``features_only`` maps come from its
    ``forward_intermediates`` (at ``out_indices``, by default ``default_out_indices``). Typed as the family's
    model, as timm's factories are, though ``features_only`` makes timm's feature wrapper of it."""
    out_indices = kwargs.pop("out_indices", default_out_indices)
    return build_model_with_cfg(
        cls, variant, pretrained, feature_cfg={"feature_cls": "getter", "out_indices": out_indices}, **kwargs
    )


def checkpoint_blocks(blocks: Iterable[Callable[..., Tensor]], x: Tensor, hw: tuple[int, int]) -> Tensor:
    """Run blocks that take ``(tokens, hw)`` in order through timm's ``checkpoint_seq``
    (activations recomputed in the backward pass). Callers keep it out of TorchScript."""
    return checkpoint_seq([partial(block, hw=hw) for block in blocks], x, use_reentrant=False)


class TimmApiMixin:
    """timm's model API for cat families whose ``forward_features`` returns normalised tokens
    (B, N, C) and whose head is ``head_drop`` then a linear ``head`` on ``num_features``.

    A family sets ``layer_groups`` (parameter-name regexes of its ``stem`` and numbered ``blocks``
    for timm's layer grouping) and calls :meth:`init_head` last in ``__init__``.
    """

    # No class-level annotations at run time: TorchScript would read them as attribute types it cannot resolve.
    if TYPE_CHECKING:  # what the family (an nn.Module) has
        num_features: int
        feature_info: list[dict[str, Any]]
        layer_groups: dict[str, str]
        stages: nn.Sequential | nn.ModuleList
        norm: nn.Module
        intermediate_formats: tuple[str, ...]

    def init_head(self, num_classes: int, drop_rate: float, global_pool: str, init: bool = True) -> None:
        """``head_drop`` and ``head``; ``init=False`` for families that initialise every module last."""
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.head_drop = nn.Dropout(drop_rate)
        self.head = self._new_head(num_classes, init)

    def _new_head(self, num_classes: int, init: bool = True) -> nn.Module:
        head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        if init:
            init_vit_weights(head)
        return head

    def forward_features(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    # What forward_intermediates can return: NCHW maps, and for CA-DeiT also tokens (NLC).
    intermediate_formats = ("NCHW",)

    def _stage_maps(
        self, x: Tensor, take: list[int], last: int, norm: bool, output_fmt: str
    ) -> tuple[Tensor, list[Tensor]]:
        """Run stages (CA-DeiT: blocks) 0..``last``; return what forward_features returns and the
        outputs of the stages in ``take`` in ``output_fmt`` (the last stage's normalised when ``norm``)."""
        raise NotImplementedError

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]]:
        """The outputs of the stages of ``feature_info`` (timm's feature API): NCHW maps at strides
        4/8/16/32, or CA-DeiT's per-block stride-16 maps."""
        if output_fmt not in self.intermediate_formats:
            raise ValueError(f"{type(self).__name__} intermediates are {' or '.join(self.intermediate_formats)}")
        take, max_index = feature_take_indices(len(self.feature_info), indices)
        last = max_index if stop_early else len(self.feature_info) - 1
        final, intermediates = self._stage_maps(x, take, last, norm, output_fmt)
        return intermediates if intermediates_only else (final, intermediates)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=1)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        # Norms and biases are exempt through the optimizer factory; families add their embeddings.
        return set()

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for module in cast(nn.Module, self).modules():  # the model itself, or its stages
            if hasattr(module, "grad_checkpointing"):
                module.grad_checkpointing = enable  # type: ignore[assignment]  # a bool attribute, not a submodule

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return {
            "stem": self.layer_groups["stem"],
            "blocks": [(self.layer_groups["blocks"], None), (r"^norm", (99999,))],
        }

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = global_pool
        self.head = self._new_head(num_classes)

    def prune_intermediate_layers(
        self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Drop what a feature extractor never uses (timm's API): the stages after the last of ``indices``,
        the head and, optionally, the final norm. DistributedDataParallel rejects parameters without
        gradients, so backbones prune them."""
        take, max_index = feature_take_indices(len(self.feature_info), indices)
        if hasattr(self, "stages"):  # hierarchical models (CA-DeiT's blocks: its own override)
            self.stages = self.stages[: max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take
