"""Datasets that need no download: scikit-learn's bundled digits, and a synthetic set for tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

__all__ = ["DIGITS_MEAN", "DIGITS_STD", "digits_dataset", "digits_images", "synthetic_dataset"]

# Per-channel statistics of the upsampled digits (ink fraction is small); applied so the data is
# roughly zero-mean, unit-variance like normalised ImageNet.
DIGITS_MEAN, DIGITS_STD = 0.30, 0.40


def digits_images(split: str, img_size: int = 32, val_fraction: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 8x8 handwritten digits of ``split`` (train or val), upsampled (bilinear) to
    ``img_size``: greyscale images (n, 1, img_size, img_size) in [0, 1] and their labels (n,).

    The train/val split is stratified and fixed (``random_state=0``), so every run and every rank
    sees the same split.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.from_numpy(digits.images).float().div_(16.0)  # (n, 8, 8) in [0, 1]
    labels = torch.from_numpy(digits.target).long()
    train_idx, val_idx = train_test_split(
        torch.arange(len(labels)).numpy(), test_size=val_fraction, random_state=0, stratify=labels.numpy()
    )
    idx = torch.from_numpy(train_idx if split == "train" else val_idx)
    x = F.interpolate(images[idx, None], size=(img_size, img_size), mode="bilinear", align_corners=False)
    return x, labels[idx]


def digits_dataset(split: str, img_size: int = 32, val_fraction: float = 0.2) -> TensorDataset:
    """:func:`digits_images` made 3-channel and normalised with the digits' statistics."""
    x, labels = digits_images(split, img_size, val_fraction)
    x = ((x - DIGITS_MEAN) / DIGITS_STD).expand(-1, 3, -1, -1).contiguous()
    return TensorDataset(x, labels)


def synthetic_dataset(
    split: str,
    num_classes: int = 10,
    img_size: int | tuple[int, int] = 32,
    samples_per_class: int = 16,
    noise: float = 0.5,
    seed: int = 0,
) -> TensorDataset:
    """Learnable random data: each class is a fixed random image plus per-sample noise.

    Deterministic in ``seed``; the train and val splits share the class patterns but not the noise.
    """
    h, w = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    patterns = torch.randn(num_classes, 3, h, w, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + (1 if split == "train" else 2))
    labels = torch.arange(num_classes).repeat_interleave(samples_per_class)
    x = patterns[labels] + noise * torch.randn(len(labels), 3, h, w, generator=g)
    return TensorDataset(x, labels)
