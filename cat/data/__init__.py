"""The classification datasets: a registry by name (:mod:`cat.data.registry`; :mod:`cat.data.build` reads it)
over image files in folders, zips or tar shards (:mod:`cat.data.images`), scikit-learn's bundled digits and a synthetic
set; the ``data`` and ``aug`` config sections they read (:mod:`cat.data.config`). Every file is read
as untrusted (:mod:`cat.data.untrusted`)."""

from .build import SplitDataset, build_dataset, data_root_problem, dataset_problems, file_format, reads_files
from .config import AugConfig, DataConfig
from .images import IMAGE_EXTENSIONS, build_transform, load_rgb
from .packed import ZipImageDataset
from .registry import DATASETS, FORMATS
from .shards import ShardStream
from .tensor_sets import digits_dataset, synthetic_dataset

__all__ = [
    "SplitDataset",
    "AugConfig",
    "DataConfig",
    "DATASETS",
    "FORMATS",
    "file_format",
    "build_dataset",
    "dataset_problems",
    "data_root_problem",
    "reads_files",
    "build_transform",
    "digits_dataset",
    "synthetic_dataset",
    "load_rgb",
    "IMAGE_EXTENSIONS",
    "ZipImageDataset",
    "ShardStream",
]
