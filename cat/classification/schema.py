"""The classification config (``train_cls.py``): its typed schema, and the rules between keys that
need the model, the optimizer or the machine to check. :func:`check_config` runs both before any
data or weights are read."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from cat.data.packed import CACHE_MODES
from cat.errors import CheckpointError, ConfigError, UserError
from cat.models import model_arguments
from cat.runtime import run_dir_for
from cat.runtime.logger import run_id_problem
from cat.runtime.resume import resumes, starting_file_problem
from cat.runtime.rundir import check_writable
from cat.runtime.schema import JobConfig, key, mapping_problems, register_schema, schema_problems, section

from .checkpoints import LAST

__all__ = ["ClsConfig", "check_config", "input_size", "recorded_model_config"]

# timm's per-step schedulers (plateau needs a metric at every step, which the trainer does not give)
SCHEDULERS = ("cosine", "tanh", "step", "multistep", "poly", "constant", "wsd", "rsqrt")


@dataclass
class ClsModelConfig:
    name: str = key("a registered model: cat's (ca_deit_tiny, ca_pvt_small, ...) or any timm model")
    drop_path_rate: float | None = key("stochastic depth; null: the model factory's value", min=0, max=1)
    kwargs: dict[str, Any] = key("extra model arguments, checked against the model's, e.g. {embed_dim: 64}")
    lean_attention: Any = key(
        "circulant attention's memory-lean backward: auto (blocks of B*N*C >= cat.ops.LEAN_AUTO_MIN_FLOATS), "
        "true (every block: least memory) or false (autograd: faster, more memory)",
        choices=("auto", True, False),
    )
    grad_checkpointing: bool = key("recompute each block's activations in the backward (timm's set_grad_checkpointing)")
    convert: dict[str, Any] | None = key(
        "cat.convert a timm ViT/Swin/PVT v2 to circulant attention: {} (defaults), {stages: [0, 1]}, ..."
    )


@dataclass
class ClsDataConfig:
    name: str = key("the dataset", choices=("imagenet", "folder", "digits", "synthetic"))
    root: str | None = key(
        "imagenet/folder: holds <train_split>/<class>/ and <val_split>/<class>/ (mode=throughput reads no data)"
    )
    num_classes: int | None = key("classes; null (folder): one per class folder", min=1)
    img_size: int = key("training and evaluation resolution (square)", min=1)
    format: str = key(
        "imagenet/folder: folder (<split>/<class>/*.jpg), zip (<split>.zip + <split>_map.txt) or tar "
        "(<split>-NNNNNN.tar shards); tools/pack_dataset.py packs a folder",
        choices=("folder", "zip", "tar"),
        required=False,
    )
    cache_mode: str = key(
        "zip: images held in memory: no, part (each rank its 1/world share, sampling only it) or full",
        choices=CACHE_MODES,
        required=False,
    )
    shuffle_buffer: int = key("tar: samples in the training stream's shuffle buffer", min=1, required=False)
    max_image_mb: float = key(
        "imagenet/folder: the largest image file (or zip/tar member, by its directory or header) read; larger is "
        "refused before it is inflated",
        min=0,
        exclusive_min=True,
        required=False,
    )
    train_split: str = key("imagenet/folder: the training folder under root", required=False)
    val_split: str = key("imagenet/folder: the validation folder under root", required=False)
    crop_pct: float = key(
        "eval: resize to img_size / crop_pct, centre crop", min=0, max=1, exclusive_min=True, required=False
    )
    interpolation: str = key(
        "resize interpolation", choices=("bicubic", "bilinear", "nearest", "lanczos", "random"), required=False
    )
    mean: list[float] = key("normalisation mean per channel", required=False)
    std: list[float] = key("normalisation std per channel", min=0, exclusive_min=True, required=False)
    samples_per_class: int = key("synthetic: images per class", min=1, required=False)
    seed: int = key("synthetic: the images' seed", min=0, required=False)


@dataclass
class AugConfig:
    auto_augment: str | None = key("timm's auto-augment policy, e.g. rand-m9-mstd0.5-inc1; null: none")
    color_jitter: float | None = key("colour jitter strength; null: none", min=0)
    hflip: float = key("horizontal flip probability", min=0, max=1)
    reprob: float = key("random erasing probability", min=0, max=1)
    remode: str = key("random erasing fill", choices=("pixel", "rand", "const"))
    recount: int = key("random erasing regions", min=1)
    mixup: float = key("mixup alpha; 0: off", min=0)
    cutmix: float = key("cutmix alpha; 0: off", min=0)
    mixup_prob: float = key("probability of mixing a batch", min=0, max=1)
    mixup_switch_prob: float = key("probability of cutmix rather than mixup when both are on", min=0, max=1)
    mixup_mode: str = key("mix per batch, per pair or per element", choices=("batch", "pair", "elem"))
    smoothing: float = key("label smoothing", min=0, max=1, exclusive_max=True)


@dataclass
class OptimConfig:
    opt: str = key("any timm optimizer name (timm.optim.list_optimizers())")
    weight_decay: float = key("none on norms, biases and the model's no_weight_decay()", min=0)
    kwargs: dict[str, Any] = key("passed to the optimizer as is, checked against its arguments")
    momentum: float = key("for momentum optimizers", min=0)
    clip_grad: float | None = key("max gradient norm; null: no clipping", min=0, exclusive_min=True)
    lr_base_batch: int | None = key("lr is scaled by global_batch / lr_base_batch; null: lr as given", min=1)


@dataclass
class ScheduleConfig:
    sched: str = key("timm scheduler, updated every step", choices=SCHEDULERS)
    warmup_epochs: float = key("linear warm-up from warmup_lr", min=0)
    warmup_lr: float = key("lr at the start of warm-up", min=0)
    min_lr: float = key("the schedule's floor", min=0)
    cooldown_epochs: float = key("epochs at min_lr after the schedule", min=0)


@dataclass
class EmaConfig:
    enabled: bool = key("keep an exponential moving average of the weights (evaluated as ema_top1, saved as model_ema)")
    decay: float = key("EMA decay per step", min=0, max=1)


@dataclass
class ThroughputConfig:
    batch_size: int = key("images per forward", min=1)
    img_size: int | None = key("null: data.img_size", min=1)
    warmup: int = key("untimed forwards first", min=0)
    iters: int = key("timed forwards", min=1)


@dataclass
class ClsConfig(JobConfig):
    mode: str = key("train, eval a checkpoint, or measure throughput", choices=("train", "eval", "throughput"))
    model: ClsModelConfig = section(ClsModelConfig, "the network")
    data: ClsDataConfig = section(ClsDataConfig, "the dataset")
    aug: AugConfig = section(AugConfig, "training augmentation (timm's)")
    optim: OptimConfig = section(OptimConfig, "the optimizer (timm's)")
    schedule: ScheduleConfig = section(ScheduleConfig, "the learning-rate schedule (timm's)")
    epochs: int = key("training epochs", min=1)
    batch_size: int = key("images per process and forward; the global batch is batch_size x world x accum_steps", min=1)
    accum_steps: int = key("forwards (micro-batches) per optimizer step, gradients accumulated", min=1)
    lr: float = key("peak learning rate at a global batch of optim.lr_base_batch", min=0, exclusive_min=True)
    compile: bool = key("torch.compile the model")
    channels_last: bool = key("channels-last memory format")
    ema: EmaConfig = section(EmaConfig, "weight EMA")
    checkpoint_ema: bool = key(
        "take checkpoint='s weight EMA (model_ema) instead of its model weights: to start training or measure "
        "throughput (mode=eval evaluates both without it)"
    )
    pin_memory: bool = key("pinned host memory for CUDA input copies")
    deterministic: bool = key("torch.use_deterministic_algorithms (slower; CPU resumes are bit-exact without it)")
    throughput: ThroughputConfig = section(ThroughputConfig, "mode=throughput")


register_schema("cls", ClsConfig)


def input_size_key(cfg: DictConfig) -> str:
    """The key that sets the input size: throughput.img_size when throughput mode sets one."""
    return "throughput.img_size" if cfg.mode == "throughput" and cfg.throughput.img_size else "data.img_size"


def input_size(cfg: DictConfig) -> tuple[int, int]:
    """The (height, width) the run feeds its model."""
    size = OmegaConf.select(cfg, input_size_key(cfg))
    return size, size


def _model_problems(cfg: DictConfig) -> list[str]:
    """Whether the model builds and runs at the configured input size: a forward on the meta device
    (no memory, no compute) catches sizes the patch grid or windows cannot take."""
    from .builders import build_model

    hw = input_size(cfg)
    try:
        with torch.device("meta"):
            build_model(cfg, cfg.data.num_classes or 2).eval()(torch.empty(1, 3, *hw))
    except ConfigError as error:
        return error.problems
    except UserError as error:
        return [str(error)]
    except Exception as error:  # the model's own complaint about its arguments or the input size
        return [
            f"model={cfg.model.name} with model.kwargs={OmegaConf.to_container(cfg.model.kwargs)} does not run at "
            f"{hw[0]}x{hw[1]} ({input_size_key(cfg)}): {str(error).strip().splitlines()[0]}"
        ]
    return []


def _model_kwargs_problems(cfg: DictConfig) -> list[str]:
    """``model.kwargs`` are arguments of the model, and those that size it are positive."""
    try:
        accepted = model_arguments(cfg.model.name)
    except ConfigError as error:
        return [f"model.name: {problem}" for problem in error.problems]
    problems = []
    for name, value in (cfg.model.kwargs or {}).items():
        if accepted is not None and name not in accepted:
            problems.append(
                f"model.kwargs.{name}: not an argument of {cfg.model.name} (accepted: {', '.join(sorted(accepted))})"
            )
            continue
        values = list(value) if OmegaConf.is_list(value) else [value]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if name in _SIZE_KWARGS and (len(numbers) < len(values) or any(v <= 0 for v in numbers)):
            problems.append(f"model.kwargs.{name}={value}: sizes the network, must be positive")
    return problems


# model.kwargs that size the network: each value (or list entry) must be positive.
_SIZE_KWARGS = frozenset(
    ("depth", "depths", "embed_dim", "embed_dims", "num_heads", "head_dim", "patch_size", "mlp_ratio", "mlp_ratios")
    + ("window_size", "sr_ratios")
)


def _optimizer_problems(cfg: DictConfig) -> list[str]:
    """``optim.opt`` is a timm optimizer and ``optim.kwargs`` are arguments it takes."""
    from timm.optim import get_optimizer_class, list_optimizers

    if cfg.optim.opt not in list_optimizers():
        return [f"optim.opt={cfg.optim.opt!r}: not a timm optimizer (timm.optim.list_optimizers() lists them)"]
    parameters = inspect.signature(get_optimizer_class(cfg.optim.opt, bind_defaults=False)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return []
    accepted = sorted(set(parameters) - {"self", "params", "lr", "weight_decay"})
    unknown = [k for k in cfg.optim.kwargs or {} if k not in parameters]
    return [f"optim.kwargs.{k}: not an argument of {cfg.optim.opt} (accepted: {', '.join(accepted)})" for k in unknown]


# The data keys only some datasets have (the schema lets them be absent), by dataset.
_IMAGE_FOLDER_KEYS = (
    "format",
    "cache_mode",
    "shuffle_buffer",
    "max_image_mb",
    "train_split",
    "val_split",
    "crop_pct",
    "interpolation",
    "mean",
    "std",
)
_DATASET_KEYS = {
    "imagenet": _IMAGE_FOLDER_KEYS,
    "folder": _IMAGE_FOLDER_KEYS,
    "synthetic": ("samples_per_class", "seed"),
}


def _dataset_problems(cfg: DictConfig) -> list[str]:
    needed = _DATASET_KEYS.get(cfg.data.name, ())
    problems = [f"data.{name}: missing (data={cfg.data.name} needs it)" for name in needed if name not in cfg.data]
    if not problems and cfg.data.get("format") in ("folder", "tar") and cfg.data.cache_mode != "no":
        problems.append(
            f"data.cache_mode={cfg.data.cache_mode}: caches a zip (data.format=zip), not a {cfg.data.format}"
        )
    return problems


def _augment_problems(cfg: DictConfig) -> list[str]:
    """timm parses ``aug.auto_augment`` when a file dataset's transform is built: build it (no data
    needed). The tensor datasets (digits, synthetic) take no image transform."""
    from cat.data import build_transform

    if cfg.data.name not in ("imagenet", "folder"):
        return []
    try:
        build_transform(cfg.data, cfg.aug, is_train=True)
    except Exception as error:
        message = str(error).strip().splitlines()[0]
        return [f"aug.auto_augment={cfg.aug.auto_augment!r}: timm cannot build the training transform ({message})"]
    return []


def _memory_problems(cfg: DictConfig) -> list[str]:
    """Inputs that cannot fit: one batch of input images alone against this machine's memory."""
    hw = input_size(cfg)
    batch = cfg.throughput.batch_size if cfg.mode == "throughput" else cfg.batch_size
    need = batch * 3 * hw[0] * hw[1] * 4
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need <= have:
        return []
    return [
        f"{input_size_key(cfg)}={hw[0]}x{hw[1]} with batch {batch}: one batch of input images alone takes "
        f"{need / 1e9:.1f} GB ({batch} x 3 x {hw[0]} x {hw[1]} x 4 bytes), more than this machine's "
        f"{have / 1e9:.1f} GB of memory"
    ]


def _paths_problems(cfg: DictConfig) -> list[str]:
    problems = []
    if cfg.device == "cuda" and not torch.cuda.is_available():
        problems.append("device=cuda: CUDA is not available on this machine")
    if cfg.checkpoint is not None and not resumes(cfg, LAST):
        problems += [problem] if (problem := starting_file_problem(cfg, "checkpoint", cfg.checkpoint)) else []
    if cfg.checkpoint_ema and cfg.checkpoint is None:
        problems.append("checkpoint_ema=true takes a checkpoint's weight EMA: give checkpoint=PATH")
    if cfg.checkpoint_ema and cfg.mode == "eval":
        problems.append("checkpoint_ema=true: mode=eval evaluates the checkpoint's weights and their EMA both; drop it")
    # Throughput runs the model on random images: it reads no dataset, so it needs no data.root.
    if (
        cfg.mode != "throughput"
        and cfg.data.name in ("imagenet", "folder")
        and not (isinstance(cfg.data.root, str) and os.path.isdir(cfg.data.root))
    ):
        splits = (cfg.data.get("train_split"), cfg.data.get("val_split"))
        layout = {
            "zip": f"{splits[0]}.zip, {splits[0]}_map.txt, {splits[1]}.zip and {splits[1]}_map.txt (data.format=zip)",
            "tar": f"{splits[0]}-NNNNNN.tar and {splits[1]}-NNNNNN.tar shards with manifest.json (data.format=tar)",
        }.get(cfg.data.get("format"), f"{splits[0]}/<class>/ and {splits[1]}/<class>/ image folders")
        problems.append(f"data.root={cfg.data.root}: not a folder (data={cfg.data.name} needs {layout})")
    if (problem := check_writable(cfg.output_dir, "output_dir")) is not None:
        problems.append(problem)
    if cfg.logger.wandb.mode != "disabled" and (problem := run_id_problem(run_dir_for(cfg.output_dir, cfg.mode))):
        problems.append(problem)
    return problems


# A recorded run config's model keys, with the value a run that predates one of them had (configs/cls/config.yaml's).
_RECORDED_MODEL_KEYS = {"drop_path_rate": None, "kwargs": {}, "lean_attention": "auto", "convert": None}


def recorded_model_config(trained: dict[str, Any], source: str, img_size: int | None = None) -> DictConfig:
    """What builds the model of a run from the config its checkpoint ``source`` records
    (:func:`~cat.classification.checkpoints.recorded_config`), as :func:`~cat.classification.builders.build_model`
    takes it: ``model.*`` and ``data.img_size`` (``img_size`` in its place when given) and ``data.num_classes``.
    A CheckpointError naming the file where a value is not one a run records (the file is the user's: anything
    may be in it)."""
    model = {k: trained["model"].get(k, default) for k, default in _RECORDED_MODEL_KEYS.items()}
    model |= {"name": trained["model"]["name"], "grad_checkpointing": False}
    data = trained.get("data") if isinstance(trained.get("data"), dict) else {}
    data = {"img_size": img_size or data.get("img_size"), "num_classes": data.get("num_classes")}
    problems = mapping_problems(model, ClsModelConfig, "model.") + [
        problem  # of the data section's keys, these two (the others are the data's, not the model's)
        for problem in mapping_problems(data, ClsDataConfig, "data.")
        if problem.startswith(("data.img_size", "data.num_classes"))
    ]
    if "${" in repr(model):  # a recorded config is resolved: an interpolation is not a run's
        problems.append("model: holds an interpolation (${...})")
    if not problems:
        cfg = OmegaConf.create({"mode": "eval", "model": model, "data": data})
        problems = _model_kwargs_problems(cfg)
    if problems:
        raise CheckpointError(f"{source}: its recorded run config builds no model: {'; '.join(problems)}")
    return cfg


def check_config(cfg: DictConfig) -> None:
    """Every problem with a classification config, before data or weights are read (ConfigError).

    The schema first; the rules that build things (optimizer, transform, model) only run on keys
    the schema passed, so one mistake is reported once."""
    problems = schema_problems(cfg, ClsConfig) or _dataset_problems(cfg)
    if problems:
        raise ConfigError(problems)
    problems = _paths_problems(cfg) + _optimizer_problems(cfg) + _augment_problems(cfg)
    sizes = _model_kwargs_problems(cfg)
    problems += sizes or _memory_problems(cfg)
    if not sizes:
        problems += _model_problems(cfg)
    if problems:
        raise ConfigError(problems)
