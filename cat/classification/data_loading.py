"""A classification run's data: both splits, their samplers (an epoch that can start part-way) and loaders."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

from cat.data import ShardStream, SplitDataset, build_dataset, file_format
from cat.data.packed import RankShardSampler
from cat.errors import ConfigError
from cat.runtime import DistEnv
from cat.runtime.preemption import worker_context

from .schema import ClsConfig

__all__ = ["ResumableSampler", "ShardSampler", "num_classes_of", "val_loader", "TrainData", "build_train_data"]


class ResumableSampler(Sampler[int]):
    """A DistributedSampler (or RankShardSampler) whose epoch can start part-way (after ``skip``
    samples of this rank)."""

    def __init__(self, base: DistributedSampler | RankShardSampler) -> None:
        self.base = base
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.base.set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.base), self.skip, None)

    def __len__(self) -> int:
        return len(self.base) - self.skip


class ShardSampler(Sampler[int]):
    """Every ``world``-th index from ``rank``: each sample evaluated exactly once across ranks."""

    def __init__(self, size: int, rank: int, world: int) -> None:
        self.indices = range(rank, size, world)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def num_classes_of(cfg: ClsConfig, dataset: SplitDataset | None) -> int:
    """``data.num_classes``, else as many as ``dataset`` (a split of image files) has."""
    if cfg.data.num_classes is not None:
        return int(cfg.data.num_classes)
    if dataset is None or isinstance(dataset, TensorDataset):  # the config's check names it first
        raise ConfigError(f"data={cfg.data.name} needs data.num_classes")
    return len(dataset.classes)  # image files: one class per folder, or as the packed split lists them


def val_loader(cfg: ClsConfig, dataset: SplitDataset, env: DistEnv) -> DataLoader:
    # A tar stream splits its shards over the ranks itself; files read by index are split here.
    streamed = (spec := file_format(cfg.data)) is not None and spec.streamed  # it splits its samples over the ranks
    sampler = None if streamed else ShardSampler(len(dataset), env.rank, env.world_size)
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=cfg.workers,
        multiprocessing_context=worker_context(cfg.workers),
        pin_memory=cfg.pin_memory and env.device.type == "cuda",
    )


@dataclass
class TrainData:
    train_set: SplitDataset
    val_set: SplitDataset
    num_classes: int
    sampler: ResumableSampler | ShardStream  # set_epoch(epoch, skip): where an epoch starts
    train_loader: DataLoader
    val_loader: DataLoader
    steps_per_epoch: int  # optimizer steps, each of accum_steps batches
    global_batch: int  # images per optimizer step, all ranks
    accum_steps: int = 1


def build_train_data(cfg: ClsConfig, env: DistEnv, run_folder: str | None = None) -> TrainData:
    """Both splits and their loaders; the train sampler can start an epoch part-way (a resume). An
    epoch is as many optimizer steps as whole global batches fit (a remainder is left out, as
    ``drop_last`` leaves one out of a loader). The validation split's labels are bounded by the
    training split's classes; ``run_folder`` caches what is read from shards without a manifest."""
    args = (cfg.data, cfg.aug)
    train_set = build_dataset(*args, "train", env.rank, env.world_size, cfg.batch_size, cfg.seed, index_dir=run_folder)
    classes = num_classes_of(cfg, train_set)
    val_set = build_dataset(*args, "val", env.rank, env.world_size, cfg.batch_size, cfg.seed, classes, run_folder)
    global_batch = cfg.batch_size * env.world_size * cfg.accum_steps
    if (cfg.aug.mixup > 0 or cfg.aug.cutmix > 0) and cfg.batch_size % 2:
        raise ConfigError(f"batch_size={cfg.batch_size} must be even when mixup/cutmix is on (they pair samples)")
    if len(train_set) < global_batch:
        raise ConfigError(
            f"the train split has {len(train_set)} images, fewer than one global batch of "
            f"{global_batch} (batch_size={cfg.batch_size} x {env.world_size} processes x accum_steps={cfg.accum_steps})"
        )
    spec = file_format(cfg.data)
    streamed = spec is not None and spec.streamed
    if streamed:  # the stream orders itself and resumes from its set_epoch
        assert isinstance(train_set, ShardStream)  # what a streamed format's reader makes
        sampler: ResumableSampler | ShardStream = train_set
    elif spec is not None and spec.caches and cfg.data.cache_mode == "part":  # each rank its own share
        sampler = ResumableSampler(RankShardSampler(len(train_set), env.rank, env.world_size, seed=cfg.seed))
    else:
        sampler = ResumableSampler(
            DistributedSampler(
                train_set, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=cfg.seed, drop_last=True
            )
        )
    train_loader = DataLoader(
        train_set,
        batch_size=cfg.batch_size,
        sampler=None if streamed else sampler,
        drop_last=True,
        num_workers=cfg.workers,
        multiprocessing_context=worker_context(cfg.workers),
        pin_memory=cfg.pin_memory and env.device.type == "cuda",
        # A stream's workers take its epoch when they start: new ones each epoch.
        persistent_workers=cfg.workers > 0 and not streamed,
    )
    per_rank = len(sampler.base) if isinstance(sampler, ResumableSampler) else len(train_set)
    return TrainData(
        train_set,
        val_set,
        classes,
        sampler,
        train_loader,
        val_loader(cfg, val_set, env),
        per_rank // (cfg.batch_size * cfg.accum_steps),
        global_batch,
        cfg.accum_steps,
    )
