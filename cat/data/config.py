"""The ``data`` and ``aug`` config sections of a classification run, declared next to the datasets that read
them (keys only some datasets have are ``required=False``; :mod:`cat.data.registry` says which)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cat.runtime.schema import FREE, key

from .packed import CacheMode
from .registry import DATASETS, FORMATS, DatasetName, FormatName

__all__ = ["DataConfig", "AugConfig"]


@dataclass
class DataConfig:
    """The ``data`` section: which dataset (:data:`~cat.data.registry.DATASETS`), where, and how its images are read."""

    name: DatasetName = key("the dataset: " + "; ".join(f"{name}: {spec.doc}" for name, spec in DATASETS.items()))
    root: str | None = key(
        "imagenet/folder: holds <train_split>/<class>/ and <val_split>/<class>/ (mode=throughput reads no data)",
        resume=FREE,
        in_run_name=False,
    )
    num_classes: int | None = key("classes; null (folder): one per class folder", min=1)
    img_size: int = key("training and evaluation resolution (square)", min=1)
    format: FormatName = key(
        "imagenet/folder: "
        + ", ".join(f"{name} ({spec.doc})" for name, spec in FORMATS.items())
        + "; tools/pack_dataset.py packs a folder",
        required=False,
    )
    cache_mode: CacheMode = key(
        "zip: images held in memory: no, part (each rank its 1/world share, sampling only it) or full",
        required=False,
    )
    shuffle_buffer: int = key("tar: samples in the training stream's shuffle buffer", min=1, required=False)
    max_image_mb: float = key(
        "imagenet/folder: the largest image file (or zip/tar member, by its directory or header) read; larger is "
        "refused before it is inflated",
        min=0,
        exclusive_min=True,
        required=False,
    )
    train_split: str = key("imagenet/folder: the training folder under root", required=False)
    val_split: str = key("imagenet/folder: the validation folder under root", required=False)
    decode_draft: bool = key(
        "imagenet/folder, training: decode each JPEG at the least scale (1/2, 1/4, 1/8) its random crop allows "
        "(Pillow's draft): the crops timm draws, fewer pixels decoded (faster loading, slightly other pixels)",
        required=False,
        resume=FREE,  # how the same crops are decoded, not which
    )
    normalize_on_device: bool = key(
        "imagenet/folder, training: the loader hands over uint8 images and the training device converts, "
        "normalises and randomly erases them (timm's prefetcher): less CPU per image, 4x fewer bytes to copy",
        required=False,
        resume=FREE,  # the same transform, its last steps computed elsewhere
    )
    crop_pct: float = key("eval: resize to img_size / crop_pct, centre crop", min=0.05, max=1, required=False)
    interpolation: Literal["bicubic", "bilinear", "nearest", "lanczos", "random"] = key(
        "resize interpolation", required=False
    )
    mean: list[float] = key("normalisation mean per channel", required=False)
    std: list[float] = key("normalisation std per channel", min=0, exclusive_min=True, required=False)
    samples_per_class: int = key("synthetic: images per class", min=1, required=False)
    seed: int = key("synthetic: the images' seed", min=0, required=False)


@dataclass
class AugConfig:
    """The ``aug`` section: timm's training augmentation, mixup/cutmix and label smoothing."""

    auto_augment: str | None = key("timm's auto-augment policy, e.g. rand-m9-mstd0.5-inc1; null: none")
    color_jitter: float | None = key("colour jitter strength; null: none", min=0)
    hflip: float = key("horizontal flip probability", min=0, max=1)
    reprob: float = key("random erasing probability", min=0, max=1)
    remode: Literal["pixel", "rand", "const"] = key("random erasing fill")
    recount: int = key("random erasing regions", min=1)
    mixup: float = key("mixup alpha; 0: off", min=0)
    cutmix: float = key("cutmix alpha; 0: off", min=0)
    mixup_prob: float = key("probability of mixing a batch", min=0, max=1)
    mixup_switch_prob: float = key("probability of cutmix rather than mixup when both are on", min=0, max=1)
    mixup_mode: Literal["batch", "pair", "elem"] = key("mix per batch, per pair or per element")
    smoothing: float = key("label smoothing", min=0, max=1, exclusive_max=True)
