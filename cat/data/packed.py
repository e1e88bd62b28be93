"""Image datasets packed into one file per split: the authors' zip layout with its memory cache.

A split ``<split>`` is ``<root>/<split>.zip`` plus ``<root>/<split>_map.txt``, one line per image:
``<member path in the zip><TAB><label>`` (the layout of the authors' ``--zip`` option, which
``tools/pack_dataset.py`` writes from an image folder). ``cache_mode`` is theirs too:

* ``no``   — each image is read from the zip when it is loaded (one open zip per worker process);
* ``part`` — each of ``world`` ranks holds the compressed bytes of its ``1/world`` share in memory
  and samples only that share (:class:`RankShardSampler`), so the filesystem serves each image
  once per run, not once per epoch;
* ``full`` — every rank holds every image's bytes.

``root/manifest.json`` (written by the packer) names the classes and each packed file's size, image
count and sha256; when it is there, a split is checked against it before use (sizes and counts:
cheap), so a truncated or replaced file is one line naming it.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset, Sampler

from cat.errors import DataError

__all__ = ["CACHE_MODES", "ZipImageDataset", "RankShardSampler", "read_manifest", "check_against_manifest", "MANIFEST"]

CACHE_MODES = ("no", "part", "full")
MANIFEST = "manifest.json"


def read_manifest(root: str) -> dict[str, Any] | None:
    """``root/manifest.json`` as written by ``tools/pack_dataset.py``; None when there is none."""
    path = os.path.join(root, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError("no 'files' table")
        return manifest
    except (OSError, ValueError) as error:
        raise DataError(f"{path} is not a dataset manifest ({error}); re-run tools/pack_dataset.py") from None


def check_against_manifest(path: str, manifest: dict[str, Any] | None, images: int | None = None) -> None:
    entry = (manifest or {}).get("files", {}).get(os.path.basename(path))
    if entry is None:
        return
    size = os.path.getsize(path)
    if size != entry.get("bytes"):
        raise DataError(
            f"{path} has {size} bytes, its manifest says {entry.get('bytes')}: the file is truncated or was "
            "replaced; re-copy it or re-run tools/pack_dataset.py"
        )
    if images is not None and images != entry.get("images"):
        raise DataError(f"{path} lists {images} images, its manifest says {entry.get('images')}")


def _read_map(path: str) -> list[tuple[str, int]]:
    if not os.path.isfile(path):
        raise DataError(f"no image list {path} (the zip layout: <split>.zip and <split>_map.txt)")
    entries = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            member, tab, label = line.rstrip("\n").rpartition("\t")
            if not tab or not label.strip().isdigit():
                raise DataError(f"{path}, line {number}: expected '<path in the zip><TAB><label>', got {line!r}")
            entries.append((member, int(label)))
    if not entries:
        raise DataError(f"{path} lists no images")
    return entries


class ZipImageDataset(Dataset):
    """One split of a zip-packed image dataset: ``(transform(image), label)`` per index.

    Args:
        root: the folder holding ``<split>.zip``, ``<split>_map.txt`` and, optionally, the manifest.
        split: the split's name (``train``, ``val``).
        transform: applied to each RGB PIL image.
        cache_mode: ``no``, ``part`` or ``full`` (module docstring).
        rank, world: this process's share under ``part``: indices ``rank, rank + world, ...``.
    """

    def __init__(
        self,
        root: str,
        split: str,
        transform: Callable[[Image.Image], Any] | None = None,
        cache_mode: str = "no",
        rank: int = 0,
        world: int = 1,
    ) -> None:
        if cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode={cache_mode!r}: expected one of {', '.join(CACHE_MODES)}")
        self.zip_path = os.path.join(root, f"{split}.zip")
        self.transform, self.cache_mode, self.rank, self.world = transform, cache_mode, rank, world
        if not os.path.isfile(self.zip_path):
            raise DataError(f"no {self.zip_path} (data.format=zip reads <root>/<split>.zip and <split>_map.txt)")
        manifest = read_manifest(root)
        self.samples = _read_map(os.path.join(root, f"{split}_map.txt"))
        check_against_manifest(self.zip_path, manifest, len(self.samples))
        self.targets = [label for _, label in self.samples]
        # The packer's class names; an authors' zip has only labels: their numbers stand in.
        self.classes = (
            list(manifest["classes"])
            if manifest and "classes" in manifest
            else [str(i) for i in range(max(self.targets) + 1)]
        )
        bad_label = next((label for label in self.targets if not 0 <= label < len(self.classes)), None)
        if bad_label is not None:
            raise DataError(
                f"{os.path.join(root, f'{split}_map.txt')} has label {bad_label}, not one of the "
                f"{len(self.classes)} classes of {os.path.join(root, MANIFEST)}"
            )
        self._zip: zipfile.ZipFile | None = None
        self._zip_pid: int | None = None
        members = set(self._archive().namelist())
        missing = next((m for m, _ in self.samples if m not in members), None)
        if missing is not None:
            raise DataError(f"{self.zip_path} has no member {missing!r}, which its image list names")
        self.cache: dict[int, bytes] = {}
        if cache_mode != "no":
            self.cache = {i: self._read(i) for i in self.cached_indices()}

    def cached_indices(self) -> range:
        """The indices whose bytes this rank holds (``part``: its share; ``full``: all)."""
        return range(self.rank, len(self.samples), self.world) if self.cache_mode == "part" else range(len(self))

    def cached_bytes(self) -> int:
        return sum(len(b) for b in self.cache.values())

    def image_bytes(self) -> int:
        """The bytes of all this split's images as stored (what ``full`` holds on each rank)."""
        sizes = {info.filename: info.file_size for info in self._archive().infolist()}
        return sum(sizes[member] for member, _ in self.samples)

    def _archive(self) -> zipfile.ZipFile:
        # One open zip per process: a handle inherited across fork would share its file offset.
        if self._zip is None or self._zip_pid != os.getpid():
            try:
                self._zip = zipfile.ZipFile(self.zip_path)
            except (OSError, zipfile.BadZipFile) as error:
                raise DataError(f"cannot open {self.zip_path} ({error}): truncated or not a zip file") from None
            self._zip_pid = os.getpid()
        return self._zip

    def _read(self, index: int) -> bytes:
        member = self.samples[index][0]
        try:
            return self._archive().read(member)
        except (OSError, zipfile.BadZipFile, KeyError) as error:  # a bad CRC is a BadZipFile
            raise DataError(f"cannot read {member} from {self.zip_path} ({error}); re-pack or re-copy it") from None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if self.cache_mode != "no" and index not in self.cache:
            raise IndexError(
                f"index {index} is not in rank {self.rank}'s share of {self.zip_path} (cache_mode=part samples "
                "only its own share: use RankShardSampler)"
            )
        data = self.cache[index] if self.cache_mode != "no" else self._read(index)
        try:
            with Image.open(io.BytesIO(data)) as image:
                rgb = image.convert("RGB")
        except OSError as error:
            member = self.samples[index][0]
            raise DataError(f"cannot decode {member} in {self.zip_path} ({error}); replace it and re-pack") from None
        return (self.transform(rgb) if self.transform is not None else rgb), self.samples[index][1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_zip": None, "_zip_pid": None}  # workers open their own


class RankShardSampler(Sampler[int]):
    """Indices ``rank, rank + world, ...`` (the share ``cache_mode=part`` holds), shuffled per epoch
    (``seed`` + epoch) when ``shuffle``, cut to the length every rank has so all take the same steps.
    ``set_epoch`` as ``DistributedSampler``'s, so :class:`~cat.classification.builders.ResumableSampler`
    wraps either."""

    def __init__(self, size: int, rank: int, world: int, seed: int = 0, shuffle: bool = True) -> None:
        self.indices = torch.arange(rank, size, world)[: size // world]
        self.seed, self.shuffle, self.epoch = seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(self.indices.tolist())
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(self.indices[torch.randperm(len(self.indices), generator=generator)].tolist())

    def __len__(self) -> int:
        return len(self.indices)
