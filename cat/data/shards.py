"""Image datasets in webdataset tar shards, streamed sequentially (``data.format=tar``).

A split is ``<root>/<split>-000000.tar``, ``-000001.tar``, ..., each holding ``<key>.<image ext>``
and ``<key>.cls`` (the label) per image, as ``tools/pack_dataset.py --format tar`` writes them with
``manifest.json`` beside them; webdataset reads them. The reader needs the manifest: its image
counts fix the epoch's length before a shard is opened, and its byte counts catch a truncated shard.

Training (:class:`ShardStream`):

* each epoch the shards are put in an order seeded by ``seed`` and the epoch, the same on every rank;
  rank ``r`` takes every ``world``-th of them from ``r``, and its DataLoader worker ``w`` every
  ``workers``-th of those from ``w``;
* samples pass a shuffle buffer of ``buffer`` samples (seeded per epoch, rank and worker), drained
  at the end of each pass over the rank's shards, so an image does not repeat within a pass, and
  no more samples are read than the epoch still takes;
* every rank yields exactly ``images // world`` samples, rounded down to whole batches: a rank whose
  shards hold fewer starts its shards over, one whose shards hold more stops (so every rank takes
  the same number of steps, as ``DistributedSampler(drop_last=True)`` gives the other formats);
* a stream is a pure function of (seed, epoch, rank, worker), so a resumed epoch replays it and
  skips what was trained: ``skip`` samples of the rank, split over the workers as the DataLoader
  took their batches (round robin), the workers' roles rotated so the next batch comes from the
  worker whose turn it was. Skipped samples are read from the tar but not decoded.

Validation streams each rank's shards once, in order: every image is evaluated once across ranks.
"""

from __future__ import annotations

import io
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info

from cat.errors import DataError

from .packed import check_against_manifest, read_manifest

__all__ = ["ShardStream", "shard_paths"]

_IMAGE_KEYS = ("jpg", "jpeg", "png", "ppm", "bmp", "pgm", "tif", "tiff", "webp")


def shard_paths(root: str, split: str) -> list[str]:
    """The split's shards, in name order."""
    if not os.path.isdir(root):
        raise DataError(f"data.root={root}: not a folder")
    names = sorted(n for n in os.listdir(root) if n.startswith(f"{split}-") and n.endswith(".tar"))
    if not names:
        raise DataError(f"no {split}-*.tar shards in {root} (data.format=tar: tools/pack_dataset.py --format tar)")
    return [os.path.join(root, n) for n in names]


def _raise_named(error: Exception) -> bool:
    source = next((a for a in reversed(getattr(error, "args", ())) if isinstance(a, str) and a.endswith(".tar")), "")
    raise DataError(f"cannot read shard {source or '(unknown)'} ({type(error).__name__}: {error})") from None


class ShardStream(IterableDataset):
    """One split of a tar-sharded image dataset as a stream of ``(transform(image), label)``.

    Args:
        root, split: where the shards and ``manifest.json`` are, and the split's name.
        transform: applied to each RGB PIL image.
        train: the training stream (shuffled, fixed length) or the evaluation one (each image once).
        rank, world: this process among the ranks.
        batch_size: the training stream's length is whole batches of it, per rank.
        seed, buffer: the shuffle's seed and its buffer size (samples).
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
    ) -> None:
        manifest = read_manifest(root)
        self.shards = shard_paths(root, split)
        if manifest is None:
            raise DataError(f"{root} has no manifest.json: data.format=tar needs tools/pack_dataset.py's manifest")
        missing = [s for s in self.shards if os.path.basename(s) not in manifest["files"]]
        if missing:
            raise DataError(f"{missing[0]} is not in {root}/manifest.json: a stray shard, or the manifest is stale")
        for shard in self.shards:
            check_against_manifest(shard, manifest)
        self.counts = [int(manifest["files"][os.path.basename(s)]["images"]) for s in self.shards]
        empty = next((s for s, count in zip(self.shards, self.counts, strict=True) if count == 0), None)
        if empty is not None:
            raise DataError(f"{empty} holds no images (its manifest says 0): remove it, or re-pack")
        self.classes = list(manifest.get("classes", []))
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

    def _my_shards(self, worker: int, workers: int) -> list[str]:
        order = list(range(len(self.shards)))
        if self.train:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        mine = order[self.rank :: self.world][worker::workers]
        if self.train and not mine:
            raise DataError(
                f"{len(self.shards)} shards cannot feed {self.world} rank(s) x {workers} worker(s): pack with a "
                "smaller --shard-mb, or use fewer workers"
            )
        return [self.shards[i] for i in mine]

    def _passes(self, shards: list[str], rng: random.Random | None, limit: int) -> Iterator[dict[str, Any]]:
        """The shards' samples, pass after pass when training (a rank whose shards hold fewer than
        its quota starts them over), each pass through the shuffle buffer and drained at its end,
        so within a pass no image repeats, and no pass reads past the ``limit`` samples the stream
        still needs; one unshuffled pass when evaluating."""
        from webdataset.tariterators import tarfile_samples

        total = 0
        while True:
            samples = tarfile_samples(({"url": s} for s in shards), handler=_raise_named)
            produced = 0
            for sample in samples if rng is None else self._shuffled(samples, rng, limit - total):
                produced += 1
                yield sample
            total += produced
            if not self.train:
                return
            if not produced:  # starting them over would never end
                raise DataError(f"shards {', '.join(shards)} hold no samples (their manifest says otherwise)")

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
        name = f"{sample.get('__key__')} in {sample.get('__url__')}"
        data = next((sample[k] for k in _IMAGE_KEYS if k in sample), None)
        if data is None or "cls" not in sample:
            raise DataError(f"sample {name} has no image or no .cls label (keys: {sorted(sample)})")
        try:
            with Image.open(io.BytesIO(data)) as image:
                rgb = image.convert("RGB")
            label = int(sample["cls"])
        except (OSError, ValueError) as error:
            raise DataError(f"cannot decode sample {name} ({error}); re-pack the shard") from None
        if self.classes and not 0 <= label < len(self.classes):
            raise DataError(f"sample {name} has label {label}, not one of the {len(self.classes)} classes")
        return (self.transform(rgb) if self.transform is not None else rgb), label

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if not self.train:
            for sample in self._passes(self._my_shards(worker, workers), None, 0):
                yield self._decode(sample)
            return
        role = self._role(worker, workers)
        rng = random.Random(hash((self.seed, self.epoch, self.rank, role)))
        quota, skip = self._quota(role, workers)
        stream = self._passes(self._my_shards(role, workers), rng, quota)
        for position, sample in enumerate(stream):
            if position >= quota:
                return
            if position >= skip:
                yield self._decode(sample)
