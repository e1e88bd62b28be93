"""The datasets a classification run can read, by name, and the file formats they read, by name: what builds each,
the ``data.*`` keys a dataset needs, and for a format its layout under ``data.root``, whether it caches and whether
it orders its own samples. The config's schema (its choices and docs), ``--help``, its checks, the trainer and
:func:`build_dataset` all read these tables: adding a dataset or a format is one entry here."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch.utils.data import Dataset

from cat.errors import ConfigError

from .images import read_folder, read_shards, read_zip
from .request import SplitRequest
from .tensor_sets import digits_dataset, synthetic_dataset

__all__ = [
    "DatasetSpec",
    "DATASETS",
    "FormatSpec",
    "FORMATS",
    "file_format",
    "build_dataset",
    "dataset_problems",
    "data_root_problem",
    "reads_files",
]

# A dataset builder: (data section, aug section, what to read) -> Dataset.
DatasetBuilder = Callable[[Any, Any, SplitRequest], Dataset]


@dataclass(frozen=True)
class DatasetSpec:
    build: DatasetBuilder
    doc: str
    keys: tuple[str, ...] = ()  # the data keys (declared required=False) this dataset needs
    reads_files: bool = False  # image files under data.root, in one of FORMATS (data.format)


@dataclass(frozen=True)
class FormatSpec:
    """How image files lie under ``data.root`` (``data.format``) and what reads them."""

    read: DatasetBuilder
    doc: str  # the split's files, as the format key's doc names them
    layout: str  # what data.root must hold (both splits), for the message when it does not
    packed: bool  # a few large files per split (tools/pack_dataset.py) rather than a file per image
    caches: bool = False  # reads data.cache_mode (images held in memory)
    streamed: bool = False  # orders and deals its own samples to ranks and workers: no sampler


FORMATS: dict[str, FormatSpec] = {
    "folder": FormatSpec(
        read_folder,
        "<split>/<class>/*.jpg",
        "{train}/<class>/ and {val}/<class>/ image folders",
        packed=False,
    ),
    "zip": FormatSpec(
        read_zip,
        "<split>.zip + <split>_map.txt",
        "{train}.zip, {train}_map.txt, {val}.zip and {val}_map.txt (data.format=zip)",
        packed=True,
        caches=True,
    ),
    "tar": FormatSpec(
        read_shards,
        "<split>-NNNNNN.tar shards",
        "{train}-NNNNNN.tar and {val}-NNNNNN.tar shards with manifest.json (data.format=tar)",
        packed=True,
        streamed=True,
    ),
}


def _image_files(data: Any, aug: Any, request: SplitRequest) -> Dataset:
    return FORMATS[data.format].read(data, aug, request)


def _digits(data: Any, aug: Any, request: SplitRequest) -> Dataset:
    return digits_dataset(request.split, img_size=data.img_size)


def _synthetic(data: Any, aug: Any, request: SplitRequest) -> Dataset:
    return synthetic_dataset(
        request.split,
        num_classes=data.num_classes,
        img_size=data.img_size,
        samples_per_class=data.samples_per_class,
        seed=data.seed,
    )


_IMAGE_FILES = DatasetSpec(
    _image_files,
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
    reads_files=True,
)

DATASETS: dict[str, DatasetSpec] = {
    "imagenet": replace(_IMAGE_FILES, doc="ImageNet-1K's files under data.root"),
    "folder": replace(_IMAGE_FILES, doc="any image files in ImageNet's layout under data.root, a class per folder"),
    "digits": DatasetSpec(_digits, "scikit-learn's bundled handwritten digits (no files)"),
    "synthetic": DatasetSpec(
        _synthetic, "a random image per class plus noise (no files)", keys=("samples_per_class", "seed")
    ),
}


def file_format(data: Any) -> FormatSpec | None:
    """The format ``data`` reads its image files in (:data:`FORMATS`); None for a dataset without files."""
    return FORMATS[data.format] if reads_files(data) else None


def reads_files(data: Any) -> bool:
    """Whether ``data.name`` reads image files under ``data.root`` (through timm's transform)."""
    return DATASETS[data.name].reads_files


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
    if not problems and spec.reads_files and not FORMATS[data.format].caches and data.cache_mode != "no":
        caching = " or ".join(name for name, f in FORMATS.items() if f.caches)
        problems.append(
            f"data.cache_mode={data.cache_mode}: caches a {caching} (data.format={caching}), not a {data.format}"
        )
    return problems


def data_root_problem(data: Any) -> str | None:
    """Where the dataset reads files: a ``data.root`` that is no folder, with the layout its format needs."""
    if not reads_files(data) or (isinstance(data.root, str) and os.path.isdir(data.root)):
        return None
    layout = FORMATS[data.format].layout.format(train=data.train_split, val=data.val_split)
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
    ``world`` (:class:`~cat.data.request.SplitRequest` says what each argument is for). ``num_classes`` defaults
    to ``data.num_classes``."""
    if split not in ("train", "val"):
        raise ConfigError(f"split must be 'train' or 'val', got {split!r}")
    spec = DATASETS.get(data.name)
    if spec is None:
        raise ConfigError(f"unknown dataset {data.name!r}; choose {', '.join(DATASETS)}")
    if spec.reads_files and data.root is None:
        raise ConfigError(f"data={data.name} needs data.root=/path/to/dataset ({spec.doc})")
    classes = num_classes if num_classes is not None else data.num_classes
    return spec.build(data, aug, SplitRequest(split, rank, world, batch_size, seed, classes, index_dir))
