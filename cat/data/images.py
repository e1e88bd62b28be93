"""Image files as a dataset: the ImageNet layout read as ``data.format=folder`` (``<split>/<class>/*.jpg``,
through torchvision's ``ImageFolder``), ``zip`` (the authors' ``<split>.zip`` + ``<split>_map.txt``, with
their ``data.cache_mode``: :mod:`cat.data.packed`) or ``tar`` (shards, streamed: :mod:`cat.data.shards`),
each image through timm's transform pipeline."""

from __future__ import annotations

import functools
import logging
import math
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torchvision.transforms.functional as F
from PIL import Image
from timm.data import create_transform
from timm.data.random_erasing import RandomErasing
from timm.data.transforms import RandomResizedCropAndInterpolation
from torch.utils.data import Dataset
from torchvision.transforms import Compose

from cat.errors import ConfigError, DataError
from cat.runtime.logger import DATA_LOGGER

from .augment import install_timm_augment_fixes
from .config import AugConfig, DataConfig
from .folders import IMAGE_EXTENSIONS, class_folders, escaping_name, folder_index, is_within
from .index import IndexSamples, SampleIndex, return_freed_memory
from .packed import ZipImageDataset
from .registry import DATASETS
from .request import SplitRequest
from .shards import ShardStream
from .untrusted import as_rgb, check_image_size, check_label_array, decode_image, image_limit, open_regular

__all__ = [
    "IMAGE_EXTENSIONS",
    "load_rgb",
    "build_transform",
    "DeviceNormalize",
    "build_batch_transform",
    "DraftCrop",
    "build_decoding",
    "read_folder",
    "read_zip",
    "read_shards",
    "IndexedImageFolder",
]


def load_rgb(
    path: str,
    max_image_mb: float | None = None,
    draft: Callable[[Image.Image], Image.Image] | None = None,
    follow_links: bool = True,
) -> Image.Image:
    """An image file as RGB: a regular file of at most ``max_image_mb``; one that cannot be decoded
    raises a DataError naming it. ``draft``: decodes the opened file itself (:class:`DraftCrop`). ``follow_links``
    False: a link at the path's last part is refused (a dataset's reader opens the path it resolved and checked)."""
    with open_regular(path, follow_links) as f:
        check_image_size(os.fstat(f.fileno()).st_size, image_limit(max_image_mb), f"image {path}")
        return decode_image(f, f"image {path}", draft)


class DraftCrop:
    """timm's random resized crop, done while decoding (``data.decode_draft``): the crop is drawn from the
    image's header size exactly as timm draws it (the same calls on the same random state), then a JPEG is
    decoded at the smallest scale Pillow's ``draft`` offers (1/2, 1/4, 1/8) that still leaves the crop at least
    its output size, and the crop, its box scaled alike, is resized to the output. The crop's place and size in
    the image are timm's; only the decoded pixels differ a little (the JPEG's DCT scaling stands in for the first
    part of the resize). Another format, or a crop too small to draft, gives exactly timm's result."""

    def __init__(self, crop: RandomResizedCropAndInterpolation) -> None:
        self.crop = crop
        self.last_scale = 1.0  # the decode scale of the last image (what a test sees)

    def __call__(self, image: Image.Image) -> Image.Image:
        i, j, h, w = self.crop.get_params(image, self.crop.scale, self.crop.ratio)
        interpolation = self.crop.interpolation
        if isinstance(interpolation, (tuple, list)):
            interpolation = random.choice(interpolation)
        out_h, out_w = self.crop.size
        full_w, full_h = image.size
        enough = max(out_w / w, out_h / h)  # the least scale at which the crop still covers the output
        if enough < 1 and image.format == "JPEG":
            image.draft("RGB", (math.ceil(full_w * enough), math.ceil(full_h * enough)))
        self.last_scale = image.size[0] / full_w
        rgb = as_rgb(image)  # as the plain path decodes: a 16-bit image scaled, not clipped at 255
        if rgb.size == (full_w, full_h):
            return F.resized_crop(rgb, i, j, h, w, [out_h, out_w], interpolation)
        fx, fy = rgb.size[0] / full_w, rgb.size[1] / full_h
        box = (j * fx, i * fy, (j + w) * fx, (i + h) * fy)
        return rgb.resize((out_w, out_h), F.pil_modes_mapping[interpolation], box=box)


def build_decoding(data: DataConfig, aug: AugConfig, is_train: bool) -> tuple[DraftCrop | None, Any]:
    """How a file dataset turns an encoded image into a tensor: ``(draft, transform)``. ``draft`` is None unless
    ``data.decode_draft`` asks for it when training: then it decodes and crops (:class:`DraftCrop`) and
    ``transform`` is the rest of timm's pipeline."""
    transform = build_transform(data, aug, is_train)
    if not (is_train and data.decode_draft):
        return None, transform
    first, *rest = transform.transforms
    if not isinstance(first, RandomResizedCropAndInterpolation):  # timm changed its pipeline: not silently wrong
        raise TypeError(f"timm's training transform starts with {type(first).__name__}, not its random resized crop")
    return DraftCrop(first), Compose(rest)


def read_zip(data: DataConfig, aug: AugConfig, request: SplitRequest) -> ZipImageDataset:
    """A zip-packed split (:mod:`cat.data.packed`); validation is cached as ``part`` whenever training caches at
    all (each rank evaluates its own share)."""
    cache_mode = "part" if not request.train and data.cache_mode != "no" else data.cache_mode
    draft, transform = build_decoding(data, aug, request.train)
    return ZipImageDataset(
        data_root(data),
        split_name(data, request),
        transform,
        cache_mode,
        request.rank,
        request.world,
        request.num_classes,
        data.max_image_mb,
        draft,
        request.index_dir,
    )


def read_shards(data: DataConfig, aug: AugConfig, request: SplitRequest) -> ShardStream:
    """A tar-sharded split, streamed (:mod:`cat.data.shards`)."""
    draft, transform = build_decoding(data, aug, request.train)
    return ShardStream(
        data_root(data),
        split_name(data, request),
        transform,
        request.train,
        request.rank,
        request.world,
        request.batch_size,
        request.seed,
        data.shuffle_buffer,
        request.num_classes,
        data.max_image_mb,
        request.index_dir,
        draft,
    )


def data_root(data: DataConfig) -> str:
    """The folder the dataset's files are under; a dataset of files without one is refused."""
    if data.root is None:
        raise ConfigError(f"data={data.name} needs data.root=/path/to/dataset ({DATASETS[data.name].doc})")
    return data.root


def split_name(data: DataConfig, request: SplitRequest) -> str:
    return data.train_split if request.train else data.val_split


def read_folder(data: DataConfig, aug: AugConfig, request: SplitRequest) -> IndexedImageFolder:
    """An image-folder split (:mod:`cat.data.folders`), through torchvision ImageFolder's order."""
    root = data_root(data)
    folder = os.path.join(root, split_name(data, request))
    if not os.path.isdir(folder):
        raise DataError(
            f"dataset split folder not found: {folder} (data.root={data.root}; expected "
            f"the ImageNet layout {data.train_split}/<class>/*.jpg and {data.val_split}/<class>/*.jpg)"
        )
    classes = class_folders(folder)
    if not classes:
        loose = sum(entry.name.lower().endswith(IMAGE_EXTENSIONS) for entry in os.scandir(folder))
        raise DataError(
            f"no class folders in {folder}"
            + (
                f" (it holds {loose} images directly, as ImageNet's val archive unpacks: a split needs them sorted "
                "into one folder per class, e.g. by the devkit's ground-truth labels)"
                if loose
                else ""
            )
        )
    train_folder = os.path.join(root, data.train_split)
    if not request.train and os.path.isdir(train_folder) and classes != (train_classes := class_folders(train_folder)):
        # A label is its folder's index in the sorted list, so a class missing from one split shifts the rest.
        missing, extra = sorted(set(train_classes) - set(classes)), sorted(set(classes) - set(train_classes))
        raise DataError(
            f"{folder} and {train_folder} hold different class folders (labels are indices into each split's "
            f"sorted folders, so they would not agree): not in {data.val_split}: {_some(missing)}; not in "
            f"{data.train_split}: {_some(extra)}"
        )
    if data.num_classes is not None and len(classes) != data.num_classes:
        raise DataError(f"{folder} has {len(classes)} class folders but data.num_classes={data.num_classes}")
    draft, transform = build_decoding(data, aug, request.train)
    loader = functools.partial(load_rgb, max_image_mb=data.max_image_mb, draft=draft, follow_links=False)
    index = folder_index(folder, classes, root, request.index_dir)
    return IndexedImageFolder(folder, classes, index, transform, loader, inside=root)


class IndexedImageFolder(Dataset):
    """An image folder split read from its index (:func:`~cat.data.folders.folder_index`): torchvision
    ImageFolder's samples, in its order, with its ``classes``, ``class_to_idx``, ``targets`` (an array)
    and ``samples`` (made when asked for), but no Python object per image."""

    def __init__(
        self,
        root: str,
        classes: list[str],
        index: SampleIndex,
        transform: Callable[[Image.Image], Any] | None = None,
        loader: Callable[[str], Any] = load_rgb,
        inside: str | None = None,
    ) -> None:
        self.root, self.classes, self.index, self.transform, self.loader = root, classes, index, transform, loader
        # Where every image must resolve (data.root; default the split): an index kept in a run folder is read
        # again by each run, and one altered there could name a link out of it. The listing's own rule, per read.
        self.inside = os.path.realpath(inside if inside is not None else root)
        self.class_to_idx = {name: label for label, name in enumerate(classes)}
        check_label_array(index.labels, len(classes), root, lambda i: f"{root}: sample {i} of its index")
        escaping = escaping_name(index)
        if escaping is not None:
            raise DataError(f"{index.path}: sample {escaping} is named {index.name(escaping)!r:.80}: an altered index")
        if empty := np.flatnonzero(np.bincount(index.labels, minlength=len(classes)) == 0).tolist():
            raise DataError(
                f"class folder {os.path.join(root, classes[empty[0]])} holds no images ({', '.join(IMAGE_EXTENSIONS)})"
            )
        if count := index.meta["left_out_count"]:
            logging.getLogger(DATA_LOGGER).warning(
                "%s: %d entries left out (only regular files inside data.root are read), e.g. %s",
                root,
                count,
                "; ".join(map(str, index.meta["left_out"])),
            )
        self.samples = IndexSamples(index, self._path)
        return_freed_memory()

    @property
    def targets(self) -> np.ndarray:
        return self.index.labels

    def _path(self, label: int, name: str) -> str:
        return os.path.join(self.root, self.classes[label], name)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        label = int(self.index.labels[index])
        path = self._path(label, os.fsdecode(self.index.name(index)))
        real = os.path.realpath(path)
        if not is_within(real, self.inside):
            raise DataError(
                f"{path} leads out of {self.inside} (to {real}): only files inside data.root are read (an altered "
                "index, or a link changed since the listing)"
            )
        image = self.loader(real)
        return (self.transform(image) if self.transform is not None else image), label


def _some(names: list[str]) -> str:
    return (", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")) or "none"


def build_transform(data: DataConfig, aug: AugConfig, is_train: bool) -> Any:
    """timm's image pipeline for a file dataset: the ``aug`` recipe's augmentation when training,
    resize + centre crop otherwise; PIL image in, normalised (3, img_size, img_size) tensor out."""
    install_timm_augment_fixes()  # before create_transform: timm binds its ops when it builds them
    train_args: dict[str, Any] = {
        "auto_augment": aug.auto_augment,
        "re_prob": aug.reprob,
        "re_mode": aug.remode,
        "re_count": aug.recount,
        "hflip": aug.hflip,
        "color_jitter": aug.color_jitter,
    }
    return create_transform(
        input_size=data.img_size,
        is_training=is_train,
        interpolation=data.interpolation,
        mean=tuple(data.mean),
        std=tuple(data.std),
        crop_pct=data.crop_pct,
        use_prefetcher=is_train and bool(data.normalize_on_device),  # uint8 out: DeviceNormalize does the rest
        **(train_args if is_train else {}),
    )


class DeviceNormalize:
    """The end of timm's training transform for a batch on the training device (``data.normalize_on_device``),
    as timm's prefetching loader does it: uint8 images to float, normalised, randomly erased (``aug.reprob``)."""

    def __init__(self, data: DataConfig, aug: AugConfig, device: torch.device) -> None:
        self.mean = torch.tensor([255 * m for m in data.mean], device=device).view(1, 3, 1, 1)
        self.std = torch.tensor([255 * s for s in data.std], device=device).view(1, 3, 1, 1)
        self.erase = (
            RandomErasing(aug.reprob, mode=aug.remode, max_count=aug.recount, device=device) if aug.reprob > 0 else None
        )

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        images = images.float().sub_(self.mean).div_(self.std)
        return self.erase(images) if self.erase is not None else images


def build_batch_transform(data: DataConfig, aug: AugConfig, device: torch.device) -> DeviceNormalize | None:
    """What a training batch needs on the device before the model: :class:`DeviceNormalize` when the data
    section asks for it, else nothing."""
    return DeviceNormalize(data, aug, device) if data.normalize_on_device else None
