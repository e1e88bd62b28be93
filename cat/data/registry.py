"""The datasets a classification run can read, by name: what builds each, the ``data.*`` keys it needs,
whether it reads files under ``data.root``, and the ``data.format`` values it reads. The config's schema,
``--help``, its checks and :func:`build_dataset` all read this table: adding a dataset is one entry here."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch.utils.data import Dataset

from cat.errors import ConfigError

from .images import image_files_dataset
from .tensor_sets import digits_dataset, synthetic_dataset

__all__ = [
    "DatasetSpec",
    "DATASETS",
    "FORMATS",
    "build_dataset",
    "dataset_problems",
    "data_root_problem",
    "reads_files",
]

# A builder: (data section, aug section, split, rank, world, batch_size, seed, num_classes, index_dir) -> Dataset.
DatasetBuilder = Callable[[Any, Any, str, int, int, int, int, "int | None", "str | None"], Dataset]


@dataclass(frozen=True)
class DatasetSpec:
    build: DatasetBuilder
    doc: str
    keys: tuple[str, ...] = ()  # the data keys (declared required=False) this dataset needs
    formats: tuple[str, ...] = ()  # the data.format values it reads: files under data.root; () for none


def _digits(data: Any, aug: Any, split: str, *_: Any) -> Dataset:
    return digits_dataset(split, img_size=data.img_size)


def _synthetic(data: Any, aug: Any, split: str, *_: Any) -> Dataset:
    return synthetic_dataset(
        split,
        num_classes=data.num_classes,
        img_size=data.img_size,
        samples_per_class=data.samples_per_class,
        seed=data.seed,
    )


_IMAGE_FILES = DatasetSpec(
    image_files_dataset,
    "image files under data.root",
    keys=(
        "format",
        "cache_mode",
        "shuffle_buffer",
        "max_image_mb",
        "decode_draft",
        "normalize_on_device",
        "train_split",
        "val_split",
        "crop_pct",
        "interpolation",
        "mean",
        "std",
    ),
    formats=("folder", "zip", "tar"),
)

DATASETS: dict[str, DatasetSpec] = {
    "imagenet": replace(_IMAGE_FILES, doc="ImageNet-1K's files under data.root"),
    "folder": replace(_IMAGE_FILES, doc="any image files in ImageNet's layout under data.root, a class per folder"),
    "digits": DatasetSpec(_digits, "scikit-learn's bundled handwritten digits (no files)"),
    "synthetic": DatasetSpec(
        _synthetic, "a random image per class plus noise (no files)", keys=("samples_per_class", "seed")
    ),
}
FORMATS = tuple(dict.fromkeys(f for spec in DATASETS.values() for f in spec.formats))

# How each format lays a split out under data.root, for the message when data.root does not hold it.
_LAYOUTS = {
    "folder": "{train}/<class>/ and {val}/<class>/ image folders",
    "zip": "{train}.zip, {train}_map.txt, {val}.zip and {val}_map.txt (data.format=zip)",
    "tar": "{train}-NNNNNN.tar and {val}-NNNNNN.tar shards with manifest.json (data.format=tar)",
}


def reads_files(data: Any) -> bool:
    """Whether ``data.name`` reads image files under ``data.root`` (through timm's transform)."""
    return bool(DATASETS[data.name].formats)


def dataset_problems(data: Any) -> list[str]:
    """What the ``data`` section lacks for its dataset: the keys it needs, or a cache for a format without one."""
    spec = DATASETS[data.name]
    problems = [
        f"data.{name}: missing (data={data.name} needs it)" for name in spec.keys if getattr(data, name) is None
    ]
    problems += [
        f"data.{name}={value}: expected 3 numbers, one per RGB channel"
        for name in ("mean", "std")
        if (value := getattr(data, name)) is not None and len(value) != 3
    ]
    if not problems and data.format in ("folder", "tar") and data.cache_mode != "no":
        problems.append(f"data.cache_mode={data.cache_mode}: caches a zip (data.format=zip), not a {data.format}")
    return problems


def data_root_problem(data: Any) -> str | None:
    """Where the dataset reads files: a ``data.root`` that is no folder, with the layout its format needs."""
    if not reads_files(data) or (isinstance(data.root, str) and os.path.isdir(data.root)):
        return None
    layout = _LAYOUTS[data.format].format(train=data.train_split, val=data.val_split)
    return f"data.root={data.root}: not a folder (data={data.name} needs {layout})"


def build_dataset(
    data: Any,
    aug: Any,
    split: str,
    rank: int = 0,
    world: int = 1,
    batch_size: int = 1,
    seed: int = 0,
    num_classes: int | None = None,
    index_dir: str | None = None,
) -> Dataset:
    """The ``split`` ('train' or 'val') of the dataset the ``data`` section names, for process ``rank`` of
    ``world`` (what a ``cache_mode=part`` zip holds, which shards a tar stream reads; a training stream is whole
    batches of ``batch_size``, shuffled from ``seed``). ``num_classes`` (else ``data.num_classes``) bounds a
    packed split's labels: the validation split gets the training split's count. ``index_dir`` caches the header
    scan of shards without a manifest."""
    if split not in ("train", "val"):
        raise ConfigError(f"split must be 'train' or 'val', got {split!r}")
    spec = DATASETS.get(data.name)
    if spec is None:
        raise ConfigError(f"unknown dataset {data.name!r}; choose {', '.join(DATASETS)}")
    if spec.formats and data.root is None:
        raise ConfigError(f"data={data.name} needs data.root=/path/to/dataset ({spec.doc})")
    classes = num_classes if num_classes is not None else data.num_classes
    return spec.build(data, aug, split, rank, world, batch_size, seed, classes, index_dir)
