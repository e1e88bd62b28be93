"""A run's datasets, built from its typed ``data`` and ``aug`` sections: the reader of each dataset and each file
format the registry names (:mod:`cat.data.registry`), and the checks a ``data`` section gets before a run starts."""

from __future__ import annotations

import os
from collections.abc import Callable

from torch.utils.data import TensorDataset

from cat.errors import ConfigError

from .config import AugConfig, DataConfig
from .images import IndexedImageFolder, read_folder, read_shards, read_zip
from .packed import ZipImageDataset
from .registry import DATASETS, FORMATS, DatasetName, FormatName, FormatSpec
from .request import Split, SplitRequest
from .shards import ShardStream
from .tensor_sets import digits_dataset, synthetic_dataset

__all__ = [
    "SplitDataset",
    "DatasetReader",
    "READERS",
    "FORMAT_READERS",
    "file_format",
    "build_dataset",
    "dataset_problems",
    "data_root_problem",
    "reads_files",
]

# A split as a reader makes it: image files (with their classes) or tensors; each knows its length.
SplitDataset = IndexedImageFolder | ZipImageDataset | ShardStream | TensorDataset
# What reads a dataset, or a format's files: (data section, aug section, what to read) -> a split.
DatasetReader = Callable[[DataConfig, AugConfig, SplitRequest], SplitDataset]

FORMAT_READERS: dict[FormatName, DatasetReader] = {"folder": read_folder, "zip": read_zip, "tar": read_shards}


def _image_files(data: DataConfig, aug: AugConfig, request: SplitRequest) -> SplitDataset:
    return FORMAT_READERS[data.format](data, aug, request)


def _digits(data: DataConfig, aug: AugConfig, request: SplitRequest) -> SplitDataset:
    return digits_dataset(request.split, img_size=data.img_size)


def _synthetic(data: DataConfig, aug: AugConfig, request: SplitRequest) -> SplitDataset:
    if data.num_classes is None:  # the config's check names it first (dataset_problems)
        raise ConfigError("data=synthetic needs data.num_classes")
    return synthetic_dataset(
        request.split,
        num_classes=data.num_classes,
        img_size=data.img_size,
        samples_per_class=data.samples_per_class,
        seed=data.seed,
    )


READERS: dict[DatasetName, DatasetReader] = {
    "imagenet": _image_files,
    "folder": _image_files,
    "digits": _digits,
    "synthetic": _synthetic,
}


def file_format(data: DataConfig) -> FormatSpec | None:
    """The format ``data`` reads its image files in (:data:`~cat.data.registry.FORMATS`); None for a dataset
    without files."""
    return FORMATS[data.format] if reads_files(data) else None


def reads_files(data: DataConfig) -> bool:
    """Whether ``data.name`` reads image files under ``data.root`` (through timm's transform)."""
    return DATASETS[data.name].reads_files


def dataset_problems(data: DataConfig) -> list[str]:
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
    if not problems and spec.reads_files and not FORMATS[data.format].caches and data.cache_mode != "no":
        caching = " or ".join(name for name, f in FORMATS.items() if f.caches)
        problems.append(
            f"data.cache_mode={data.cache_mode}: caches a {caching} (data.format={caching}), not a {data.format}"
        )
    return problems


def data_root_problem(data: DataConfig) -> str | None:
    """Where the dataset reads files: a ``data.root`` that is no folder, with the layout its format needs."""
    if not reads_files(data) or (isinstance(data.root, str) and os.path.isdir(data.root)):
        return None
    layout = FORMATS[data.format].layout.format(train=data.train_split, val=data.val_split)
    return f"data.root={data.root}: not a folder (data={data.name} needs {layout})"


def build_dataset(
    data: DataConfig,
    aug: AugConfig,
    split: Split,
    rank: int = 0,
    world: int = 1,
    batch_size: int = 1,
    seed: int = 0,
    num_classes: int | None = None,
    index_dir: str | None = None,
) -> SplitDataset:
    """The ``split`` ('train' or 'val') of the dataset the ``data`` section names, for process ``rank`` of
    ``world`` (:class:`~cat.data.request.SplitRequest` says what each argument is for). ``num_classes`` defaults
    to ``data.num_classes``."""
    if split not in ("train", "val"):
        raise ConfigError(f"split must be 'train' or 'val', got {split!r}")
    classes = num_classes if num_classes is not None else data.num_classes
    return READERS[data.name](data, aug, SplitRequest(split, rank, world, batch_size, seed, classes, index_dir))
