"""The datasets a classification run can read, by name, and the file formats they read, by name: each one's doc,
the ``data.*`` keys a dataset needs, and for a format its layout under ``data.root``, whether it caches and whether
it orders its own samples. The config's schema (its choices and docs), ``--help``, its checks and the trainer read
these tables; what reads each name is :mod:`cat.data.build`'s (a dataset or a format is a name in its ``Literal``,
an entry here and its reader there, the type checker holding the three to one another)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

__all__ = ["DatasetName", "DatasetSpec", "DATASETS", "FormatName", "FormatSpec", "FORMATS"]

DatasetName = Literal["imagenet", "folder", "digits", "synthetic"]
FormatName = Literal["folder", "zip", "tar"]


@dataclass(frozen=True)
class DatasetSpec:
    doc: str
    keys: tuple[str, ...] = ()  # the data keys (declared required=False, or nullable) this dataset needs
    reads_files: bool = False  # image files under data.root, in one of FORMATS (data.format)


@dataclass(frozen=True)
class FormatSpec:
    """How image files lie under ``data.root`` (``data.format``)."""

    doc: str  # the split's files, as the format key's doc names them
    layout: str  # what data.root must hold (both splits), for the message when it does not
    packed: bool  # a few large files per split (tools/pack_dataset.py) rather than a file per image
    caches: bool = False  # reads data.cache_mode (images held in memory)
    streamed: bool = False  # orders and deals its own samples to ranks and workers: no sampler


FORMATS: dict[FormatName, FormatSpec] = {
    "folder": FormatSpec("<split>/<class>/*.jpg", "{train}/<class>/ and {val}/<class>/ image folders", packed=False),
    "zip": FormatSpec(
        "<split>.zip + <split>_map.txt",
        "{train}.zip, {train}_map.txt, {val}.zip and {val}_map.txt (data.format=zip)",
        packed=True,
        caches=True,
    ),
    "tar": FormatSpec(
        "<split>-NNNNNN.tar shards",
        "{train}-NNNNNN.tar and {val}-NNNNNN.tar shards with manifest.json (data.format=tar)",
        packed=True,
        streamed=True,
    ),
}

_IMAGE_FILES = DatasetSpec(
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

DATASETS: dict[DatasetName, DatasetSpec] = {
    "imagenet": replace(_IMAGE_FILES, doc="ImageNet-1K's files under data.root"),
    "folder": replace(_IMAGE_FILES, doc="any image files in ImageNet's layout under data.root, a class per folder"),
    "digits": DatasetSpec("scikit-learn's bundled handwritten digits (no files)"),
    "synthetic": DatasetSpec(
        "a random image per class plus noise (no files)", keys=("num_classes", "samples_per_class", "seed")
    ),
}
