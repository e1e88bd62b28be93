"""Image datasets packed into one file per split: the authors' zip layout with its memory cache.

A split ``<split>`` is ``<root>/<split>.zip`` plus ``<root>/<split>_map.txt``, one line per image:
``<member path in the zip><TAB><label>`` (the layout of the authors' ``--zip`` option, which
``tools/pack_dataset.py`` writes from an image folder). ``cache_mode`` is theirs too:

* ``no``   — each image is read from the zip when it is loaded (one open zip per worker process);
* ``part`` — each of ``world`` ranks holds the encoded bytes of its ``1/world`` share in memory
  (each image file as packed, JPEG or PNG, inflated from the zip if it was stored compressed; never
  decoded pixels) and samples only that share (:class:`RankShardSampler`), so the filesystem serves
  each image once per run, not once per epoch;
* ``full`` — every rank holds every image's encoded bytes.

Before anything is read: the image list is ``0 ... K-1`` labels (K from the manifest's classes,
``num_classes``, or the labels themselves) with no path listed twice; every member it names is in the
zip's directory, unencrypted, in a compression method Python reads, and at most ``max_image_mb``
inflated (the directory's size, so a decompression bomb is refused before it inflates).
``root/manifest.json`` (written by the packer, :mod:`cat.data.manifest`) names the classes and each
packed file's size, image count and sha256; when it is there, a split is checked against it (sizes
and counts: cheap), so a truncated or replaced file is one line naming it.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset, Sampler

from cat.errors import DataError

from .manifest import check_against_manifest, read_manifest
from .untrusted import check_image_size, check_labels, decode_image, image_limit, open_regular, parse_label

__all__ = ["CACHE_MODES", "ZipImageDataset", "RankShardSampler"]

CACHE_MODES = ("no", "part", "full")
# The methods zipfile inflates (stored, deflate, bzip2, lzma); anything else fails only when read.
_READABLE_METHODS = {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA}


def _read_map(path: str) -> list[tuple[str, int, int]]:
    """``(member, label, line number)`` per line of a ``<split>_map.txt``; no member twice."""
    if not os.path.lexists(path):
        raise DataError(f"no image list {path} (the zip layout: <split>.zip and <split>_map.txt)")
    with open_regular(path) as f:
        raw = f.read()
    entries, seen = [], {}
    for number, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            member, tab, label = line.rstrip(b"\r").decode("utf-8").rpartition("\t")
        except UnicodeDecodeError as error:
            raise DataError(f"{where}: not UTF-8 text ({error.reason} at byte {error.start})") from None
        if not tab:
            raise DataError(f"{where}: expected '<path in the zip><TAB><label>', got {line[:80]!r}")
        entries.append((member, parse_label(label.encode(), where), number))
        if member in seen:
            first = entries[seen[member]]
            relation = "again, with another label" if first[1] != entries[-1][1] else "twice"
            raise DataError(f"{where}: {member!r} is listed {relation} (line {first[2]}): each image once")
        seen[member] = len(entries) - 1
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
        num_classes: K (labels are 0 ... K-1); None: the manifest's classes, else the labels found.
        max_image_mb: the largest image read or cached (``data.max_image_mb``).
    """

    def __init__(
        self,
        root: str,
        split: str,
        transform: Callable[[Image.Image], Any] | None = None,
        cache_mode: str = "no",
        rank: int = 0,
        world: int = 1,
        num_classes: int | None = None,
        max_image_mb: float | None = None,
        draft: Callable[[Image.Image], Image.Image] | None = None,
    ) -> None:
        if cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode={cache_mode!r}: expected one of {', '.join(CACHE_MODES)}")
        self.zip_path = os.path.join(root, f"{split}.zip")
        self.transform, self.cache_mode, self.rank, self.world = transform, cache_mode, rank, world
        self.draft = draft
        if not os.path.lexists(self.zip_path):
            raise DataError(f"no {self.zip_path} (data.format=zip reads <root>/<split>.zip and <split>_map.txt)")
        manifest = read_manifest(root)
        map_path = os.path.join(root, f"{split}_map.txt")
        listed = _read_map(map_path)
        self.samples = [(member, label) for member, label, _ in listed]
        check_against_manifest(self.zip_path, manifest, len(self.samples))
        self.targets = [label for _, label in self.samples]
        names = manifest.get("classes") if manifest else None
        if names and num_classes is not None and len(names) > num_classes:
            raise DataError(f"{self.zip_path} has {len(names)} classes but data.num_classes={num_classes}")
        found = ((label, f"{map_path}, line {number}") for _, label, number in listed)
        count = check_labels(found, len(names) if names else num_classes, map_path)
        # The packer's class names; an authors' zip has only labels: their numbers stand in.
        self.classes = list(names) if names else [str(i) for i in range(count)]
        self._zip: zipfile.ZipFile | None = None
        self._zip_pid: int | None = None
        self._check_members(image_limit(max_image_mb))
        self.cache: dict[int, bytes] = {}
        if cache_mode != "no":
            self.cache = {i: self._read(i) for i in self.cached_indices()}

    def _check_members(self, limit: int) -> None:
        """Every listed member, from the zip's directory: there, readable, and not too large inflated."""
        directory = {info.filename: info for info in self._archive().infolist()}
        for member, _ in self.samples:
            info = directory.get(member)
            name = f"{member} in {self.zip_path}"
            if info is None:
                raise DataError(f"{self.zip_path} has no member {member!r}, which its image list names")
            if info.flag_bits & 0x1:
                raise DataError(f"{name} is encrypted: pack the images unencrypted (tools/pack_dataset.py)")
            if info.compress_type not in _READABLE_METHODS:
                raise DataError(
                    f"{name} uses compression method {info.compress_type}, which Python's zipfile cannot read "
                    "(stored, deflate, bzip2 and lzma can be read): re-pack it"
                )
            check_image_size(info.file_size, limit, name)

    def cached_indices(self) -> range:
        """The indices whose bytes this rank holds (``part``: its share; ``full``: all)."""
        return range(self.rank, len(self.samples), self.world) if self.cache_mode == "part" else range(len(self))

    def cached_bytes(self) -> int:
        return sum(len(b) for b in self.cache.values())

    def image_bytes(self) -> int:
        """The encoded bytes of all this split's images (what ``full`` holds on each rank)."""
        sizes = {info.filename: info.file_size for info in self._archive().infolist()}
        return sum(sizes[member] for member, _ in self.samples)

    def _archive(self) -> zipfile.ZipFile:
        # One open zip per process: a handle inherited across fork would share its file offset.
        if self._zip is None or self._zip_pid != os.getpid():
            try:
                self._zip = zipfile.ZipFile(open_regular(self.zip_path))
            except (OSError, zipfile.BadZipFile) as error:
                raise DataError(f"cannot open {self.zip_path} ({error}): truncated or not a zip file") from None
            self._zip_pid = os.getpid()
        return self._zip

    def _read(self, index: int) -> bytes:
        member = self.samples[index][0]
        try:
            return self._archive().read(member)
        # A bad CRC is a BadZipFile; a corrupt stream fails in its decompressor's own way.
        except (OSError, zipfile.BadZipFile, KeyError, EOFError, RuntimeError, zlib.error) as error:
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
        rgb = decode_image(data, f"{self.samples[index][0]} in {self.zip_path}", self.draft)
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
