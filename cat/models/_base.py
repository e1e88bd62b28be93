"""The parts of timm's model API that every cat family implements the same way."""
from __future__ import annotations

from typing import Sequence

import torch
from timm.models._features import feature_take_indices
from torch import Tensor, nn

from cat.layers import init_vit_weights

__all__ = ["ClassifierMixin"]


class ClassifierMixin:
    """The classifier end of timm's API for models whose ``forward_features`` returns normalised
    tokens (B, N, C) and whose head is ``head_drop`` then a linear ``head`` on ``num_features``:
    ``forward_head`` (average over tokens), ``forward``, ``get_classifier``, ``reset_classifier``;
    and ``prune_intermediate_layers`` for the hierarchical ones (their ``feature_info`` lists stages)."""

    feature_info: list[dict]
    num_classes: int
    num_features: int
    norm: nn.Module
    global_pool: str
    head: nn.Module
    head_drop: nn.Module

    def forward_features(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=1)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = global_pool
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        init_vit_weights(self.head)

    def prune_intermediate_layers(self, indices: int | Sequence[int] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """Drop what a feature extractor never uses (timm's API): the head and, optionally, the final
        norm. DistributedDataParallel rejects parameters without gradients, so backbones prune them."""
        take, _ = feature_take_indices(len(self.feature_info), indices)
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take
