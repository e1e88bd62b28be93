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

The list and the zip's directory become one :class:`~cat.data.index.SampleIndex` (names, labels, and each
member's offset, sizes, CRC and method: :mod:`cat.data.zip_directory`), built once per node and mapped by the
other ranks and every loader worker; a worker reads a member by its offset, never the directory again. A cache
is one contiguous buffer, which forked workers share rather than copy.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from collections.abc import Callable, Iterator
from typing import Any, Literal, get_args

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Sampler

from cat.errors import DataError

from .index import IndexSamples, SampleIndex, pack_names, return_freed_memory, shared_index
from .manifest import check_against_manifest, read_manifest
from .untrusted import (
    check_image_size,
    check_label_array,
    decode_image,
    file_stamp,
    image_limit,
    open_regular,
    parse_label,
)
from .zip_directory import LOCAL_HEADER_BYTES, read_directory, read_member

__all__ = ["CacheMode", "ZipImageDataset", "RankShardSampler", "zip_index"]

CacheMode = Literal["no", "part", "full"]
# The methods zipfile inflates (stored, deflate, bzip2, lzma); anything else fails only when read.
_READABLE_METHODS = [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA]
_LARGEST_LABEL = np.iinfo(np.int32).max
_MEMBER_FACTS = ("header_offsets", "compressed_sizes", "sizes", "crcs", "methods", "flags")  # read_member's order


def _read_map(path: str) -> tuple[list[bytes], np.ndarray]:
    """The members (UTF-8 bytes) and labels of a ``<split>_map.txt`` (its presence checked by the dataset), a line
    each; no member twice."""
    with open_regular(path) as f:
        raw = f.read()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as error:
        bad_line, line_start = raw.count(b"\n", 0, error.start) + 1, raw.rfind(b"\n", 0, error.start) + 1
        raise DataError(
            f"{path}, line {bad_line}: not UTF-8 text ({error.reason} at byte {error.start - line_start})"
        ) from None
    members, labels, numbers = [], [], []
    for number, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        member, tab, label = line.rstrip(b"\r").rpartition(b"\t")
        if not tab:
            raise DataError(f"{path}, line {number}: expected '<path in the zip><TAB><label>', got {line[:80]!r}")
        label = label.strip()
        value = int(label) if label.isdigit() and len(label) <= 9 else parse_label(label, f"{path}, line {number}")
        if value > _LARGEST_LABEL:
            raise DataError(f"{path}, line {number}: label {value} is no class index (at most {_LARGEST_LABEL})")
        members.append(member)
        labels.append(value)
        numbers.append(number)
    if not members:
        raise DataError(f"{path} lists no images")
    if len(set(members)) != len(members):
        first: dict[bytes, int] = {}
        for position, (member, class_index, number) in enumerate(zip(members, labels, numbers, strict=True)):
            if member in first:
                earlier = first[member]
                relation = "again, with another label" if labels[earlier] != class_index else "twice"
                shown = member.decode("utf-8")
                raise DataError(
                    f"{path}, line {number}: {shown!r} is listed {relation} (line {numbers[earlier]}): each image once"
                )
            first[member] = position
    return members, np.asarray(labels, dtype=np.int32)


def _as_listed(label: int, member: str) -> str:
    return member


def _line_of(path: str, sample: int) -> str:
    """Where sample ``sample`` of an image list is (an error's cold path: the list is read again)."""
    with open_regular(path) as f:
        listed = [number for number, line in enumerate(f.read().split(b"\n"), 1) if line.strip()]
    return f"{path}, line {listed[sample]}"


def _stamp(path: str) -> list[Any]:
    """The file's place and :func:`~cat.data.untrusted.file_stamp` (a rewrite with the same size and modification
    time kept the old index)."""
    return [os.path.realpath(path), *file_stamp(os.stat(path))]


def zip_index(zip_path: str, map_path: str, index_dir: str | None) -> SampleIndex:
    """The image list of ``map_path`` joined to the directory of ``zip_path``, as a
    :class:`~cat.data.index.SampleIndex` shared through ``index_dir``, keyed by both files' identities and times.
    The list is read each time (a second or so for ImageNet's) and a kept index whose names or labels are not the
    list's is rebuilt: one altered in a run folder, its checksum recomputed, does not train on other labels."""
    key = {"zip": _stamp(zip_path), "map": _stamp(map_path)}
    members, labels = _read_map(map_path)
    offsets, names = pack_names(members)

    def not_the_list(index: SampleIndex) -> str | None:
        same = (
            np.array_equal(index.labels, labels)
            and np.array_equal(index.arrays["name_offsets"], offsets)
            and np.array_equal(index.arrays["names"], names)
        )
        return None if same else f"its names or labels are not those of {map_path}"

    def build() -> SampleIndex:
        try:
            with open_regular(zip_path) as f:
                directory = read_directory(f)
        except (OSError, zipfile.BadZipFile) as error:
            raise DataError(f"cannot open {zip_path} ({error}): truncated or not a zip file") from None
        position = {name: i for i, name in enumerate(directory.names)}  # a name twice: the last, as zipfile
        picked = np.fromiter((position.get(m, -1) for m in members), dtype=np.int64, count=len(members))
        if (missing := np.flatnonzero(picked < 0)).size:
            member = members[missing[0]].decode("utf-8")
            raise DataError(f"{zip_path} has no member {member!r}, which its image list names")
        arrays = {field: values[picked] for field, values in directory.arrays.items()}
        return SampleIndex("zip", key, {}, {"labels": labels, "name_offsets": offsets, "names": names, **arrays})

    return shared_index(index_dir, "zip", zip_path, key, build, not_the_list)


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
        draft: decodes each opened image itself (:class:`~cat.data.images.DraftCrop`); None: to RGB.
        index_dir: where the split's index is kept for the node's other ranks (the run's folder); None: in memory.
    """

    def __init__(
        self,
        root: str,
        split: str,
        transform: Callable[[Image.Image], Any] | None = None,
        cache_mode: CacheMode = "no",
        rank: int = 0,
        world: int = 1,
        num_classes: int | None = None,
        max_image_mb: float | None = None,
        draft: Callable[[Image.Image], Image.Image] | None = None,
        index_dir: str | None = None,
    ) -> None:
        if cache_mode not in get_args(CacheMode):
            raise ValueError(f"cache_mode={cache_mode!r}: expected one of {', '.join(get_args(CacheMode))}")
        self.zip_path = os.path.join(root, f"{split}.zip")
        self.transform, self.cache_mode, self.rank, self.world = transform, cache_mode, rank, world
        self.draft = draft
        if not os.path.lexists(self.zip_path):
            raise DataError(f"no {self.zip_path} (data.format=zip reads <root>/<split>.zip and <split>_map.txt)")
        manifest = read_manifest(root)
        map_path = os.path.join(root, f"{split}_map.txt")
        if not os.path.lexists(map_path):
            raise DataError(f"no image list {map_path} (the zip layout: <split>.zip and <split>_map.txt)")
        check_against_manifest(self.zip_path, manifest)  # a truncated zip, named before its directory is read
        self.index = zip_index(self.zip_path, map_path, index_dir)
        self.samples = IndexSamples(self.index, _as_listed)
        check_against_manifest(self.zip_path, manifest, len(self.index))
        names = manifest.get("classes") if manifest else None
        if names and num_classes is not None and len(names) > num_classes:
            raise DataError(f"{self.zip_path} has {len(names)} classes but data.num_classes={num_classes}")
        count = check_label_array(
            self.index.labels, len(names) if names else num_classes, map_path, lambda i: _line_of(map_path, i)
        )
        # The packer's class names; an authors' zip has only labels: their numbers stand in.
        self.classes = list(names) if names else [str(i) for i in range(count)]
        self._check_members(image_limit(max_image_mb))
        self._file: Any = None
        self.cache, self.cache_offsets = np.empty(0, dtype=np.uint8), np.zeros(1, dtype=np.int64)
        if cache_mode != "no":
            self._fill_cache()
        return_freed_memory()

    @property
    def targets(self) -> np.ndarray:
        return self.index.labels

    def member(self, index: int) -> str:
        return self.index.name(index).decode("utf-8")

    def _check_members(self, limit: int) -> None:
        """Every listed member, from the directory's facts in the index: readable, inside the file, and not too
        large inflated (the directory's size, so a decompression bomb is refused before it inflates)."""
        arrays = self.index.arrays
        past_end = arrays["header_offsets"] + LOCAL_HEADER_BYTES + arrays["compressed_sizes"]
        checks = [
            (arrays["flags"] & 0x1 != 0, "is encrypted: pack the images unencrypted (tools/pack_dataset.py)"),
            (
                ~np.isin(arrays["methods"], _READABLE_METHODS),
                "uses compression method {method}, which Python's zipfile cannot read (stored, deflate, bzip2 and "
                "lzma can be read): re-pack it",
            ),
            (
                past_end > os.stat(self.zip_path).st_size,
                "lies past the file's end: the zip is truncated, or its index altered; re-copy it",
            ),
        ]
        for failed, why in checks:
            if (found := np.flatnonzero(failed)).size:
                first = int(found[0])
                method = int(arrays["methods"][first])
                raise DataError(f"{self.member(first)} in {self.zip_path} {why.format(method=method)}")
        if len(self.index):  # the largest member against the bound: one line naming it
            largest = int(np.argmax(arrays["sizes"]))
            check_image_size(int(arrays["sizes"][largest]), limit, f"{self.member(largest)} in {self.zip_path}")

    def _fill_cache(self) -> None:
        """This rank's images' encoded bytes end to end in one buffer (``cache_offsets``: where each starts)."""
        chosen = self.cached_indices()
        sizes = self.index.arrays["sizes"][chosen.start : chosen.stop : chosen.step]
        self.cache_offsets = np.zeros(len(chosen) + 1, dtype=np.int64)
        np.cumsum(sizes, out=self.cache_offsets[1:])
        self.cache = np.empty(int(self.cache_offsets[-1]), dtype=np.uint8)
        for slot, index in enumerate(chosen):
            data = self._read(index)
            start, end = self.cache_offsets[slot], self.cache_offsets[slot + 1]
            if len(data) != end - start:
                raise DataError(f"{self.member(index)} in {self.zip_path} is not the size its directory says")
            self.cache[start:end] = np.frombuffer(data, dtype=np.uint8)

    def cached_indices(self) -> range:
        """The indices whose bytes this rank holds (``part``: its share; ``full``: all)."""
        return range(self.rank, len(self.index), self.world) if self.cache_mode == "part" else range(len(self))

    def cached_bytes(self) -> int:
        return int(self.cache.nbytes)

    def image_bytes(self) -> int:
        """The encoded bytes of all this split's images (what ``full`` holds on each rank)."""
        return int(self.index.arrays["sizes"].sum())

    def _read(self, index: int) -> bytes:
        if self._file is None:  # positionless reads: a descriptor inherited across fork is safe to share
            self._file = open_regular(self.zip_path)
        arrays = self.index.arrays
        try:
            return read_member(
                self._file.fileno(),
                self.index.name(index),
                *(int(arrays[field][index]) for field in _MEMBER_FACTS),
            )
        # A bad CRC is a BadZipFile; a corrupt stream fails in its decompressor's own way.
        except (OSError, zipfile.BadZipFile, EOFError, RuntimeError, NotImplementedError, zlib.error) as error:
            member = self.member(index)
            raise DataError(f"cannot read {member} from {self.zip_path} ({error}); re-pack or re-copy it") from None

    def _cached(self, index: int) -> bytes:
        slot = index
        if self.cache_mode == "part":
            slot, off = divmod(index - self.rank, self.world)
            if off or not 0 <= index < len(self):
                raise IndexError(
                    f"index {index} is not in rank {self.rank}'s share of {self.zip_path} (cache_mode=part samples "
                    "only its own share: use RankShardSampler)"
                )
        return self.cache[self.cache_offsets[slot] : self.cache_offsets[slot + 1]].tobytes()

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        data = self._cached(index) if self.cache_mode != "no" else self._read(index)
        rgb = decode_image(data, f"{self.member(index)} in {self.zip_path}", self.draft)
        return (self.transform(rgb) if self.transform is not None else rgb), int(self.index.labels[index])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None}  # a spawned worker opens its own


class RankShardSampler(Sampler[int]):
    """Indices ``rank, rank + world, ...`` (the share ``cache_mode=part`` holds), shuffled per epoch
    (``seed`` + epoch) when ``shuffle``, cut to the length every rank has so all take the same steps.
    ``set_epoch`` as ``DistributedSampler``'s, so :class:`~cat.classification.data_loading.ResumableSampler`
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
