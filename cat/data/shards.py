"""Image datasets in webdataset tar shards, streamed sequentially (``data.format=tar``).

A split is ``<root>/<split>-000000.tar``, ``-000001.tar``, ..., each holding ``<key>.<image ext>``
and ``<key>.cls`` (the label) per image: webdataset's layout, as ``tools/pack_dataset.py --format tar``
writes it (with ``manifest.json`` beside the shards) and as webdataset's ``TarWriter``/``ShardWriter``,
img2dataset or timm's wds tools write it (without one). Shards are local regular files, read with the
standard library's ``tarfile``; no path is ever handed to a URL opener or a shell.

What is checked, and when (:mod:`cat.data.untrusted` for the checks every format shares):

* before training, with a manifest: every shard is listed in it, has its byte count, and its image
  count fits its bytes (a sample takes at least 2 KiB); its per-shard class counts give the labels
  (0 ... K-1) and show class-sorted shards, which are warned about. Without one (a foreign set), the
  same facts come from one scan of the tar headers and ``.cls`` members, cached in the run's folder;
* when read: each member's size (from its header, before a byte of it is read) against
  ``data.max_image_mb``; each label; a shard read to its end holds exactly its count, and ends with
  the end-of-archive blocks (a shard cut on a block boundary is no shorter archive).

Training (:class:`ShardStream`):

* each epoch the shards are put in an order seeded by ``seed`` and the epoch, the same on every rank,
  and their samples, in that order, are one sequence; rank ``r`` takes the ``r``-th span of
  ``images // world`` of them (rounded down to whole batches), dealt by the shards' counts (the
  manifest's, or the headers'), not by shard index: every rank takes the same number of steps, as
  ``DistributedSampler(drop_last=True)`` gives the other formats, and reads each shard its span
  touches once (a shard on a span's edge is read by both ranks, each its part). The rank's DataLoader
  workers split its span the same way, by the batches each hands the loader; the last
  ``images % (world x batch)`` or so samples of the epoch's order are left out, other ones each epoch;
* samples pass a shuffle buffer of ``buffer`` samples (seeded per epoch, rank and worker), drained
  at the span's end, so an image does not repeat within an epoch;
* a stream is a pure function of (seed, epoch, rank, worker), so a resumed epoch replays it and
  skips what was trained: ``skip`` samples of the rank, split over the workers as the DataLoader
  took their batches (round robin), the workers' roles rotated so the next batch comes from the
  worker whose turn it was. Skipped samples are read from the tar but not decoded.

Validation streams each rank's shards once, in order: every image is evaluated once across ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import tarfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info

from cat.errors import DataError
from cat.runtime.io import atomic_write_json
from cat.runtime.seal import seal, seal_holds

from .manifest import MANIFEST, TAR_SAMPLE_MIN_BYTES, check_against_manifest, read_manifest
from .untrusted import (
    check_image_size,
    check_labels,
    decode_image,
    file_stamp,
    image_limit,
    open_regular,
    parse_label,
    require_regular,
    warn_class_sorted,
)

__all__ = ["ShardStream", "shard_paths", "shard_samples", "scan_shard"]

_IMAGE_KEYS = ("jpg", "jpeg", "png", "ppm", "bmp", "pgm", "tif", "tiff", "webp")
# webdataset's naming: a sample's key is the member's path up to its file name's first dot, the rest its field.
_MEMBER = re.compile(r"^((?:.*/|)[^./][^./]*)\.([^/]*)$")
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ")  # gzip, bzip2, xz


def shard_paths(root: str, split: str) -> list[str]:
    """The split's shards, in name order: local regular files (nothing is ever handed to a URL opener,
    so a root like ``pipe:...`` is only a folder name)."""
    if not os.path.isdir(root):
        raise DataError(f"data.root={root}: not a folder")
    names = sorted(n for n in os.listdir(root) if n.startswith(f"{split}-") and n.endswith(".tar"))
    if not names:
        raise DataError(f"no {split}-*.tar shards in {root} (data.format=tar: tools/pack_dataset.py --format tar)")
    paths = [os.path.join(root, n) for n in names]
    for path in paths:
        require_regular(path)
    return paths


# What a sample may hold besides its image (a label, a little metadata), so one sample cannot hold many images'
# worth of fields that each pass the per-member bound.
_MAX_SAMPLE_FIELDS = 16
_SAMPLE_EXTRA_BYTES = 1 << 20


def shard_samples(path: str, limit: int, labels_only: bool = False) -> Iterator[dict[str, Any]]:
    """The samples of one shard, in order: runs of members that share a key, as ``{"__key__", "__url__",
    field: bytes}``. Each member's size is checked against ``limit`` from its header before it is read;
    ``labels_only`` reads only the ``.cls`` members' bytes (the others are ``None``) and seeks over the rest.
    A shard cut short, even on a block boundary (no end-of-archive blocks), is one line naming it."""
    with open_regular(path) as f:
        compressed = f.read(6).startswith(_COMPRESSED)
        f.seek(0)
        try:
            with tarfile.open(fileobj=f, mode="r:*" if labels_only else "r|*") as archive:
                sample: dict[str, Any] | None = None
                for member in archive:
                    archive.members.clear()  # type: ignore[attr-defined]  # tarfile keeps every member it passed: a shard's worth, per worker
                    match = _MEMBER.match(member.name)
                    if not member.isreg() or match is None:
                        continue  # folders, links, files without a field: no part of a sample
                    key, field = match[1], match[2].lower()
                    check_image_size(member.size, limit, f"member {member.name} of {path}")
                    if sample is None or sample["__key__"] != key:
                        if sample is not None:
                            yield sample
                        sample, held = {"__key__": key, "__url__": path}, 0
                    held += member.size
                    if held > limit + _SAMPLE_EXTRA_BYTES or len(sample) > _MAX_SAMPLE_FIELDS + 2:
                        raise DataError(
                            f"sample {key} of {path} holds {len(sample) - 1} fields of {held / 1e6:.1f} MB by "
                            f"{member.name}: a sample is one image of at most data.max_image_mb={limit / 1e6:g} and "
                            f"its label (at most {_MAX_SAMPLE_FIELDS} fields, {_SAMPLE_EXTRA_BYTES / 1e6:g} MB besides "
                            "the image); re-pack the shard"
                        )
                    reader = archive.extractfile(member) if not labels_only or field == "cls" else None
                    sample[field] = reader.read() if reader is not None else None
                if sample is not None:
                    yield sample
                end = archive.offset
        except (tarfile.TarError, OSError, EOFError, zlib.error) as error:
            # tarfile's open lists every method it tried, one per line: the first line says enough.
            reason = str(error).splitlines()[0].rstrip(":") if str(error) else type(error).__name__
            raise DataError(
                f"cannot read shard {path} ({reason}): truncated or not a tar file; re-copy or re-pack it"
            ) from None
        if not compressed and os.pread(f.fileno(), 2 * tarfile.BLOCKSIZE, end) != bytes(2 * tarfile.BLOCKSIZE):
            raise DataError(
                f"shard {path} ends without the end-of-archive blocks after byte {end}: it was cut short "
                "(a partial copy?); re-copy or re-pack it"
            )


def scan_shard(path: str, limit: int) -> dict[str, Any]:
    """A shard's sample count and label counts from its headers and ``.cls`` members (no image bytes
    are read), with every check :func:`shard_samples` makes: ``{"images": n, "labels": {label: count}}``."""
    labels: Counter[int] = Counter()
    images = 0
    for sample in shard_samples(path, limit, labels_only=True):
        name = f"sample {sample['__key__']} in {path}"
        if sample.get("cls") is None or not any(k in sample for k in _IMAGE_KEYS):
            raise DataError(f"{name} has no image or no .cls label (fields: {sorted(sample)})")
        labels[parse_label(sample["cls"], name)] += 1
        images += 1
    return {"images": images, "labels": dict(labels)}


_MAX_INDEX_BYTES = 64 << 20  # a shard index cache of more is not one cat wrote
_MAX_SHARD_IMAGES = 10**9


def _indexed(shards: list[str], limit: int, index_dir: str | None) -> list[dict[str, Any]]:
    """:func:`scan_shard` of each shard, cached in ``index_dir`` (the run's folder: the data's may be
    read-only) under the shards' folder, keyed by each shard's :func:`~cat.data.untrusted.file_stamp`, and sealed
    by the user's key (:mod:`cat.runtime.seal`): a cache that someone else wrote or edited is rescanned."""
    cache_path = None
    cached: dict[str, Any] = {}
    if index_dir is not None:
        digest = hashlib.sha256(os.path.realpath(os.path.dirname(shards[0])).encode()).hexdigest()[:16]
        cache_path = os.path.join(index_dir, f".shard-index-{digest}.json")
        try:
            with open_regular(cache_path) as f:
                record = json.loads(f.read(_MAX_INDEX_BYTES))
            sealed = isinstance(record, dict) and isinstance(record.get("shards"), dict)
            cached = record["shards"] if sealed and seal_holds(record["shards"], record.get("seal")) else {}
        except (DataError, OSError, ValueError, RecursionError):  # untrusted: rescanned, never believed
            cached = {}
    found, changed = [], False
    for path in shards:
        stamp = file_stamp(os.stat(path))
        entry = cached.get(os.path.basename(path))
        if not (isinstance(entry, dict) and entry.get("stamp") == stamp and _well_formed(entry)):
            entry = {"stamp": stamp, **scan_shard(path, limit)}
            entry["labels"] = {str(k): v for k, v in entry["labels"].items()}
            cached[os.path.basename(path)], changed = entry, True
        found.append({"images": entry["images"], "labels": {int(k): v for k, v in entry["labels"].items()}})
    if index_dir is not None and cache_path is not None and changed:  # a disposable cache: a torn write is rescanned
        os.makedirs(index_dir, exist_ok=True)
        atomic_write_json(cache_path, {"seal": seal(cached), "shards": cached})
    return found


def _well_formed(entry: dict[str, Any]) -> bool:
    """Whether a cached index entry is one :func:`_indexed` writes: counts that are integers in bounds, labels
    that are class indices (ASCII digits), and per-label counts that add up to the shard's."""
    labels, images = entry.get("labels"), entry.get("images")
    return (
        type(images) is int
        and 0 < images <= _MAX_SHARD_IMAGES
        and isinstance(labels, dict)
        and all(
            k.isascii() and k.isdigit() and len(k) <= 18 and type(v) is int and 0 < v <= images
            for k, v in labels.items()
        )
        and sum(labels.values()) == images
    )


class ShardStream(IterableDataset):
    """One split of a tar-sharded image dataset as a stream of ``(transform(image), label)``.

    Args:
        root, split: where the shards (and, when packed here, ``manifest.json``) are, and the split's name.
        transform: applied to each RGB PIL image.
        train: the training stream (shuffled, fixed length) or the evaluation one (each image once).
        rank, world: this process among the ranks.
        batch_size: the training stream's length is whole batches of it, per rank.
        seed, buffer: the shuffle's seed and its buffer size (samples).
        num_classes: K (labels are 0 ... K-1); None: the manifest's classes, else the labels found.
        max_image_mb: the largest member read (``data.max_image_mb``).
        index_dir: where the header scan of shards without a manifest is cached (the run's folder).
        draft: decodes each opened image itself (:class:`~cat.data.images.DraftCrop`); None: to RGB.
    """

    def __init__(
        self,
        root: str,
        split: str,
        transform: Callable[[Image.Image], Any] | None = None,
        train: bool = True,
        rank: int = 0,
        world: int = 1,
        batch_size: int = 1,
        seed: int = 0,
        buffer: int = 1000,
        num_classes: int | None = None,
        max_image_mb: float | None = None,
        index_dir: str | None = None,
        draft: Callable[[Image.Image], Image.Image] | None = None,
    ) -> None:
        self.limit, self.draft = image_limit(max_image_mb), draft
        manifest = read_manifest(root)
        self.shards = shard_paths(root, split)
        names = [os.path.basename(s) for s in self.shards]
        self.source = os.path.join(root, MANIFEST) if manifest is not None else "its tar headers"
        if manifest is not None:
            entries = manifest["files"]
            stray = next((s for s, n in zip(self.shards, names, strict=True) if n not in entries), None)
            if stray is not None:
                raise DataError(f"{stray} is not in {root}/{MANIFEST}: a stray shard, or the manifest is stale")
            for shard, name in zip(self.shards, names, strict=True):
                if "images" not in entries[name]:  # the count each shard's reader plans its epoch by
                    raise DataError(
                        f"{root}/{MANIFEST}: files[{name!r}] has no 'images' count; re-run tools/pack_dataset.py"
                    )
                check_against_manifest(shard, manifest)
                _check_fits(shard, entries[name])
            self.counts = [entries[n]["images"] for n in names]
            classes = manifest.get("classes")
            if all("class_counts" in entries[n] for n in names):
                label_counts = [dict(enumerate(entries[n]["class_counts"])) for n in names]
            else:  # packed before the manifest held class counts (class by class, as that packer wrote): the headers
                label_counts = [entry["labels"] for entry in _indexed(self.shards, self.limit, index_dir)]
        else:  # shards another tool wrote: their headers, scanned once (cached beside the run)
            index = _indexed(self.shards, self.limit, index_dir)
            self.counts = [entry["images"] for entry in index]
            classes, label_counts = None, [entry["labels"] for entry in index]
        empty = next((s for s, count in zip(self.shards, self.counts, strict=True) if count == 0), None)
        if empty is not None:
            raise DataError(f"{empty} holds no images ({self.source} says 0): remove it, or re-pack")
        if classes and num_classes is not None and len(classes) > num_classes:
            raise DataError(f"{root}/{MANIFEST} has {len(classes)} classes but data.num_classes={num_classes}")
        found = (
            (label, f"{shard} ({self.source})")
            for shard, counts in zip(self.shards, label_counts, strict=True)
            for label, n in counts.items()
            if n
        )
        self.num_classes = check_labels(found, num_classes or (len(classes) if classes else None), root)
        self.classes = list(classes) if classes else [str(i) for i in range(self.num_classes)]
        if train and rank == 0:
            warn_class_sorted(dict(zip(self.shards, label_counts, strict=True)), buffer)
        self.label_counts = label_counts
        self.transform, self.train, self.rank, self.world = transform, train, rank, world
        self.batch_size, self.seed, self.buffer = batch_size, seed, buffer
        self.epoch, self.skip = 0, 0
        total = sum(self.counts)
        self.samples_per_rank = (total // world) // batch_size * batch_size if train else total
        if train and self.samples_per_rank == 0:
            raise DataError(f"{len(self.shards)} shards of {total} images hold no batch of {batch_size} per rank")

    def __len__(self) -> int:
        """Training: the samples this rank takes per epoch. Evaluation: all the split's images."""
        return self.samples_per_rank

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """The epoch to stream, after ``skip`` samples of this rank (a resumed epoch)."""
        self.epoch, self.skip = epoch, skip

    def _order(self) -> list[int]:
        """The shards in the epoch's order (training: seeded by ``seed`` and the epoch, alike on every rank)."""
        order = list(range(len(self.shards)))
        if self.train:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def _eval_shards(self, worker: int, workers: int) -> list[int]:
        """Evaluation: every ``world``-th shard from the rank's, every ``workers``-th of those from the worker's."""
        return self._order()[self.rank :: self.world][worker::workers]

    def _span(self, role: int, workers: int) -> tuple[int, int]:
        """The samples (first, end) of the epoch's sequence that the worker in ``role`` of this rank reads."""
        first = self.rank * self.samples_per_rank + sum(self._quota(r, workers)[0] for r in range(role))
        return first, first + self._quota(role, workers)[0]

    def _touched(self, first: int, end: int) -> list[tuple[int, int]]:
        """(shard index, the sequence position of its first sample) of each shard samples ``first`` to ``end`` of
        the epoch's sequence lie in, in order."""
        touched, start = [], 0
        for index in self._order():
            if start >= end:
                break
            if start + self.counts[index] > first:
                touched.append((index, start))
            start += self.counts[index]
        return touched

    def _read_span(self, first: int, end: int) -> Iterator[dict[str, Any]]:
        """Samples ``first`` to ``end`` of the epoch's sequence: each shard they touch opened once, its
        members before ``first`` passed over undecoded."""
        for index, start in self._touched(first, end):
            for position, sample in enumerate(self._shard(index, stop=end - start), start):
                if position >= first:
                    yield sample

    def rank_shards(self, workers: int = 1) -> int:
        """How many shards this rank's epoch reads (a shard its workers split, once per worker reading it)."""
        return sum(len(self._touched(*self._span(role, workers))) for role in range(workers))

    def _shard(self, index: int, stop: int | None = None) -> Iterator[dict[str, Any]]:
        """Shard ``index``'s samples (its first ``stop``); one read to its end must find as many as its count says."""
        path, expected = self.shards[index], self.counts[index]
        found, labels = 0, Counter[int]()
        for sample in shard_samples(path, self.limit):
            found += 1
            if found > expected:
                break
            if sample.get("cls") is not None:
                labels[parse_label(sample["cls"], f"sample {sample['__key__']} in {path}")] += 1
            yield sample
            if stop is not None and found == stop < expected:  # the rest is another span's
                return
        if found == expected and labels != Counter({k: v for k, v in self.label_counts[index].items() if v}):
            raise DataError(
                f"{path} holds labels {dict(sorted(labels.items()))}, {self.source} says "
                f"{dict(sorted((k, v) for k, v in self.label_counts[index].items() if v))}: the shard was replaced "
                "or the index is stale; re-pack, or delete the shard index in the run folder (.shard-index-*.json)"
            )
        if found != expected:
            raise DataError(
                f"{path} holds {'more than ' if found > expected else ''}{found} samples, {self.source} says "
                f"{expected}: the shard was replaced or the manifest is stale; re-pack, or re-copy both"
            )

    def _shuffled(self, samples: Iterator[dict[str, Any]], rng: random.Random, limit: int) -> Iterator[dict[str, Any]]:
        """``samples`` through the shuffle buffer, reading at most ``limit`` of them."""
        held: list[dict[str, Any]] = []
        emitted = 0
        for sample in samples:
            if len(held) < self.buffer:
                held.append(sample)
            else:
                index = rng.randrange(len(held))
                held[index], sample = sample, held[index]
                emitted += 1
                yield sample
            if emitted + len(held) >= limit:
                break
        rng.shuffle(held)
        yield from held

    def _role(self, worker: int, workers: int) -> int:
        """Which worker of the uninterrupted epoch this one stands in for. The DataLoader takes
        batches from its workers round robin starting at worker 0; after ``skip`` samples the next
        batch is the one of worker ``done % workers``, so the roles rotate by ``done``."""
        return (worker + self.skip // self.batch_size) % workers

    def _quota(self, role: int, workers: int) -> tuple[int, int]:
        """(samples, samples to skip) of the worker in ``role``: whole batches, handed out round robin."""
        batches = self.samples_per_rank // self.batch_size
        mine = batches // workers + (role < batches % workers)
        done = self.skip // self.batch_size
        skipped = done // workers + (role < done % workers)
        return mine * self.batch_size, skipped * self.batch_size

    def _decode(self, sample: dict[str, Any]) -> tuple[Any, int]:
        name = f"sample {sample['__key__']} in {sample['__url__']}"
        data = next((sample[k] for k in _IMAGE_KEYS if k in sample), None)
        if data is None or sample.get("cls") is None:
            raise DataError(f"{name} has no image or no .cls label (fields: {sorted(sample)})")
        label = parse_label(sample["cls"], name)
        if label >= self.num_classes:
            raise DataError(f"{name} has label {label}, not one of the {self.num_classes} classes")
        rgb = decode_image(data, name, self.draft)
        return (self.transform(rgb) if self.transform is not None else rgb), label

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if not self.train:
            for index in self._eval_shards(worker, workers):
                for sample in self._shard(index):
                    yield self._decode(sample)
            return
        role = self._role(worker, workers)
        rng = random.Random(hash((self.seed, self.epoch, self.rank, role)))
        quota, skip = self._quota(role, workers)
        first, end = self._span(role, workers)
        for position, sample in enumerate(self._shuffled(self._read_span(first, end), rng, quota)):
            if position >= skip:
                yield self._decode(sample)


def _check_fits(path: str, entry: dict[str, Any]) -> None:
    """A manifest's image count against what the shard's bytes can hold."""
    size = os.path.getsize(path)
    if entry.get("images", 0) * TAR_SAMPLE_MIN_BYTES > size:
        raise DataError(
            f"{path}: its manifest says {entry['images']} images, but its {size} bytes hold at most "
            f"{size // TAR_SAMPLE_MIN_BYTES} (an image and its label take at least {TAR_SAMPLE_MIN_BYTES} bytes); "
            "the manifest is wrong: re-run tools/pack_dataset.py"
        )
