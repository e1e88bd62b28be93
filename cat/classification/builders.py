"""Building a classification run from its config: model, data, train state and loop options."""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

import cat
from cat.data import FORMATS, AugConfig, ShardStream, SplitDataset, build_dataset, file_format
from cat.data.images import build_batch_transform
from cat.data.packed import RankShardSampler
from cat.errors import ConfigError
from cat.flops import count_macs
from cat.models import (
    CheckpointMismatchError,
    extract_state_dict,
    load_checkpoint_file,
    load_weights,
    model_arguments,
    model_kwargs,
)
from cat.ops import set_lean_attention
from cat.runtime import DistEnv, Precision
from cat.runtime.hardware import compute_dtype, peak_tflops
from cat.runtime.logger import RUN_LOGGER
from cat.runtime.meter import StepMeter
from cat.runtime.preemption import worker_context
from cat.runtime.profiling import ProfileWindow
from cat.runtime.resume import resumes

from .checkpoints import LAST, recorded_config
from .loops import TrainOptions
from .schema import ClsConfig, ClsModelConfig
from .state import TrainState

__all__ = [
    "build_model",
    "build_mixup",
    "TrainData",
    "build_train_data",
    "val_loader",
    "num_classes_of",
    "build_train_model",
    "build_train_state",
    "build_train_options",
    "build_step_meter",
    "build_profile_window",
    "ResumableSampler",
    "ShardSampler",
]


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


def build_model(
    model_cfg: ClsModelConfig,
    num_classes: int,
    img_size: int,
    checkpoint: str | None = None,
    strict: bool = True,
    fine_tune: bool = False,
    use_ema: bool = False,
    state_dict: dict[str, Tensor] | None = None,
    trained_config: dict[str, Any] | None = None,
) -> nn.Module:
    """The model of the ``model`` section for inputs of ``img_size``: created, its ``checkpoint`` loaded (its
    weight EMA with ``use_ema``; ``state_dict``: weights the caller already read from it, ``trained_config``: the
    run config the file records), converted to circulant attention when ``model.convert`` is set. A checkpoint
    of the unconverted model loads before the conversion (fine-tuning a softmax model as a circulant one), a
    converted model's after it. To ``fine_tune``, a checkpoint's classifier for another class count is left out
    (the model's starts fresh). Weights that do not fit and were trained by a run of another model say which
    settings differ."""
    kwargs = model_kwargs(model_cfg.drop_path_rate, model_cfg.kwargs)
    accepted = model_arguments(model_cfg.name)
    if accepted is None or "img_size" in accepted:  # timm models that take any size have no img_size (pvt_v2)
        # The size it is fed (throughput.img_size in throughput mode): fixed-size models (timm's ViTs) are
        # built for it, a checkpoint's position embeddings resampled to it.
        kwargs = {"img_size": img_size, **kwargs}
    model = cat.create_model(model_cfg.name, num_classes=num_classes, **kwargs)
    conversion = model_cfg.convert
    if state_dict is None and checkpoint is not None:
        entries = load_checkpoint_file(checkpoint)
        state_dict = extract_state_dict(entries, str(checkpoint), use_ema=use_ema)
        trained_config = recorded_config(entries)
    # A converted model's checkpoint holds what the conversion adds (the gates): convert, then load.
    convert_first = (
        conversion is not None and state_dict is not None and not state_dict.keys() <= model.state_dict().keys()
    )
    if convert_first and conversion is not None:
        _convert(model, conversion)
    if state_dict is not None:
        try:
            load_weights(model, state_dict, strict, str(checkpoint), new_classifier=fine_tune)
        except CheckpointMismatchError as error:
            differences = model_differences(trained_config, model_cfg)
            if not differences:
                raise
            raise CheckpointMismatchError(
                error.report,
                str(checkpoint),
                f"its run trained {'; '.join(differences)}: build the model it was trained as (the run's "
                "config.yaml holds its settings)",
            ) from None
    if conversion is not None and not convert_first:
        _convert(model, conversion)
    if model_cfg.grad_checkpointing:
        try:
            model.set_grad_checkpointing(True)  # type: ignore[operator]  # timm's model API
        except (AssertionError, NotImplementedError) as error:  # timm's models that have none say so this way
            raise ConfigError(
                f"model.grad_checkpointing=true: {model_cfg.name} does not support it ({error})"
            ) from None
    return set_lean_attention(model, model_cfg.lean_attention)


def _convert(model: nn.Module, settings: dict[str, Any]) -> None:
    """``cat.convert`` with ``model.convert``'s settings; what it refuses is a ConfigError naming the key."""
    accepted = list(inspect.signature(cat.convert).parameters)[1:]  # after the model
    unknown = [
        f"model.convert.{k}: not an argument of cat.convert ({', '.join(accepted)})"
        for k in settings.keys() - set(accepted)
    ]
    if unknown:
        raise ConfigError(unknown)
    try:
        cat.convert(model, **settings)
    except ValueError as error:
        raise ConfigError(f"model.convert={settings}: {error}") from None


def model_differences(trained_config: dict[str, Any] | None, model_cfg: ClsModelConfig) -> list[str]:
    """``model.KEY=<trained> where this model has <current>`` for each model-defining setting in which a
    checkpoint's recorded run config (``trained_config``, None when it has none) differs from ``model_cfg``."""
    if trained_config is None:
        return []
    trained = trained_config["model"]
    return [
        f"model.{key}={trained.get(key)!r} where this model has {getattr(model_cfg, key)!r}"
        for key in ClsModelConfig.DEFINING_KEYS
        if trained.get(key) != getattr(model_cfg, key)
    ]


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


def build_train_model(cfg: ClsConfig, env: DistEnv, num_classes: int) -> nn.Module:
    """The model a training run starts with, on its device: from ``checkpoint=`` if given, unless the run resumes."""
    checkpoint = None if resumes(cfg, LAST) else cfg.checkpoint
    model = build_model(
        cfg.model,
        num_classes,
        cfg.input_size()[0],
        checkpoint=checkpoint,
        strict=cfg.strict_load,
        fine_tune=True,
        use_ema=cfg.checkpoint_ema,
    )
    return Precision.from_config(cfg.amp, env.device, cfg.channels_last).model(model)


def build_train_state(cfg: ClsConfig, env: DistEnv, data: TrainData, model: nn.Module | None = None) -> TrainState:
    """A fresh train state: the ``model`` (:func:`build_train_model` if not given), EMA, AdamW-style optimizer
    with the linearly scaled lr, the per-step schedule and the fp16 scaler (CUDA only)."""
    precision = Precision.from_config(cfg.amp, env.device, cfg.channels_last)
    if model is None:
        model = build_train_model(cfg, env, data.num_classes)
    ema = ModelEmaV3(model, decay=cfg.ema.decay) if cfg.ema.enabled else None
    lr = cfg.lr * data.global_batch / cfg.optim.lr_base_batch if cfg.optim.lr_base_batch else cfg.lr
    optimizer = create_optimizer_v2(
        model,
        opt=cfg.optim.opt,
        lr=lr,
        weight_decay=cfg.optim.weight_decay,
        momentum=cfg.optim.momentum,
        **cfg.optim.kwargs,
    )
    # The schedule is a pure function of the step, built from the current config (never restored).
    scheduler, _ = create_scheduler_v2(
        optimizer,
        sched=cfg.schedule.sched,
        num_epochs=cfg.epochs,
        warmup_epochs=cfg.schedule.warmup_epochs,  # type: ignore[arg-type]  # a fraction works; timm says int
        warmup_lr=cfg.schedule.warmup_lr,
        min_lr=cfg.schedule.min_lr,
        cooldown_epochs=cfg.schedule.cooldown_epochs,  # type: ignore[arg-type]  # as warmup_epochs
        step_on_epochs=False,
        updates_per_epoch=data.steps_per_epoch,
    )
    return TrainState(model, optimizer, scheduler, precision.grad_scaler(), ema)


def build_mixup(aug: AugConfig, num_classes: int) -> Mixup | None:
    """timm's batch mixup/cutmix (with label smoothing) of the ``aug`` recipe; None when both are off."""
    if not (aug.mixup > 0 or aug.cutmix > 0):
        return None
    return Mixup(
        mixup_alpha=aug.mixup,
        cutmix_alpha=aug.cutmix,
        prob=aug.mixup_prob,
        switch_prob=aug.mixup_switch_prob,
        mode=aug.mixup_mode,
        label_smoothing=aug.smoothing,
        num_classes=num_classes,
    )


def build_train_options(
    cfg: ClsConfig,
    env: DistEnv,
    data: TrainData,
    log_fn: Callable[[dict[str, float | None], int], None] | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
    meter: StepMeter | None = None,
    profiler: ProfileWindow | None = None,
) -> TrainOptions:
    """The loss (soft targets under mixup/cutmix, else label smoothing or plain cross-entropy) and
    everything else an epoch needs to know: where step metrics go, what measures the steps, and how a
    stop is asked for."""
    mixup_fn = build_mixup(cfg.aug, data.num_classes)
    if mixup_fn is not None:
        criterion: nn.Module = SoftTargetCrossEntropy()
    elif cfg.aug.smoothing > 0:
        criterion = LabelSmoothingCrossEntropy(cfg.aug.smoothing)
    else:
        criterion = nn.CrossEntropyLoss()
    return TrainOptions(
        criterion=criterion,
        precision=Precision.from_config(cfg.amp, env.device, cfg.channels_last),
        steps_per_epoch=data.steps_per_epoch,
        accum_steps=data.accum_steps,
        num_epochs=cfg.epochs,
        mixup_fn=mixup_fn,
        clip_grad=cfg.optim.clip_grad,
        log_interval=cfg.log_interval,
        stop_requested=stop_requested,
        log_fn=log_fn,
        batch_transform=build_batch_transform(cfg.data, cfg.aug, env.device),
        meter=meter,
        profiler=profiler,
    )


def build_step_meter(cfg: ClsConfig, env: DistEnv, model: nn.Module) -> StepMeter:
    """The meter of a training run's interval lines: the model's training FLOPs per image (3 x one forward's,
    counted at the input size) and the device's peak for the run's dtype, where one is listed."""
    log = logging.getLogger(RUN_LOGGER)
    try:
        flops: float | None = 6.0 * count_macs(model, torch.zeros(1, 3, *cfg.input_size(), device=env.device))
    except Exception as error:  # a model the counter cannot follow: no FLOP rate rather than a wrong one
        log.info("no FLOP rate in the log: counting %s's FLOPs failed (%s)", cfg.model.name, error)
        flops = None
    dtype = compute_dtype(env.device, cfg.amp.dtype if cfg.amp.enabled else None)
    peak = peak_tflops(env.device, dtype)
    if peak is None and env.is_main:
        where = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "a CPU"
        log.info("mfu is null: no listed %s peak for %s (cat.runtime.hardware.PEAK_TFLOPS)", dtype, where)
    advice = [f"more loader processes per training process (workers={cfg.workers} now, up to its CPU cores)"]
    spec = file_format(cfg.data)
    if spec is not None and not spec.packed:
        packed = " or ".join(name for name, f in FORMATS.items() if f.packed)
        advice.append(f"a packed format (data.format={packed}, tools/pack_dataset.py)")
    if spec is not None:  # image files: the opt-in decoding options
        advice.append(
            "less decoding (data.decode_draft=true, data.normalize_on_device=true, or tools/pack_dataset.py --max-side)"
        )
    advice_text = f"Try {'; '.join(advice)}; tools/bench_data.py measures the loader alone."
    return StepMeter(env.device, flops, peak, advice_text)


def build_profile_window(cfg: ClsConfig, env: DistEnv, run_folder: str, total_steps: int) -> ProfileWindow | None:
    """``profile.steps`` of rank 0 (None when off, or on other ranks); a window past the run's ``total_steps``
    says so in the log at the start, rather than record nothing without a word."""
    if cfg.profile.steps is None or not env.is_main:
        return None
    first, last = cfg.profile.steps
    if first > total_steps:
        logging.getLogger(RUN_LOGGER).warning(
            "profile.steps=[%d, %d]: this run has %d steps, so nothing will be profiled", first, last, total_steps
        )
    return ProfileWindow(first, last, run_folder, env.device, env.rank, logging.getLogger(RUN_LOGGER), cfg.profile.top)
