"""The checks of a classification config (``train_cls.py``) before any data or weights are read: the
schema's (types, ranges, unknown keys), then the rules between keys that need the dataset registry, the
model, the optimizer or the machine. :func:`check_config` returns the config as its typed object."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
from typing import Any

import torch

from cat.data import DataConfig, build_transform, data_root_problem, dataset_problems, reads_files
from cat.errors import CheckpointError, ConfigError, UserError
from cat.models import model_arguments, on_meta
from cat.runtime import run_dir_for
from cat.runtime.logger import run_id_problem
from cat.runtime.ownership import output_dir_problems
from cat.runtime.resume import resumes, starting_file_problem
from cat.runtime.schema import mapping_problems, typed_section

from .checkpoints import LAST, recorded_model_keys
from .model_building import build_model
from .schema import ClsConfig, ClsModelConfig

__all__ = ["check_config", "recorded_model_config", "RecordedModel"]


def _model_problems(cfg: ClsConfig) -> list[str]:
    """Whether the model builds and runs at the configured input size: a forward on the meta device
    (no memory, no compute) catches sizes the patch grid or windows cannot take."""
    hw = cfg.input_size()
    try:
        with on_meta():
            model = build_model(cfg.model, cfg.data.num_classes or 2, hw[0]).eval()
        with torch.device("meta"):
            model(torch.empty(1, 3, *hw))
    except ConfigError as error:
        return error.problems
    except UserError as error:
        return [str(error)]
    except Exception as error:  # the model's own complaint about its arguments or the input size
        return [
            f"model={cfg.model.name} with model.kwargs={cfg.model.kwargs} does not run at "
            f"{hw[0]}x{hw[1]} ({cfg.input_size_key()}): {str(error).strip().splitlines()[0]}"
        ]
    return []


def _model_kwargs_problems(model: ClsModelConfig) -> list[str]:
    """``model.kwargs`` are arguments of the model, and those that size it are positive."""
    try:
        accepted = model_arguments(model.name)
    except ConfigError as error:
        return [f"model.name: {problem}" for problem in error.problems]
    problems = []
    for name, value in (model.kwargs or {}).items():
        if accepted is not None and name not in accepted:
            problems.append(
                f"model.kwargs.{name}: not an argument of {model.name} (accepted: {', '.join(sorted(accepted))})"
            )
            continue
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if name in _SIZE_KWARGS and (len(numbers) < len(values) or any(v <= 0 for v in numbers)):
            problems.append(f"model.kwargs.{name}={value}: sizes the network, must be positive")
    return problems


# model.kwargs that size the network: each value (or list entry) must be positive.
_SIZE_KWARGS = frozenset(
    ("depth", "depths", "embed_dim", "embed_dims", "num_heads", "head_dim", "patch_size", "mlp_ratio", "mlp_ratios")
    + ("window_size", "sr_ratios")
)


def _optimizer_problems(cfg: ClsConfig) -> list[str]:
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


# Bounds of timm's RandAugment/AugMix option sections (``rand-m9-n2``): operations per image (n), mixing width (w)
# and chain depth (d), each a loop per image (n=9999 trained at 2 images/s), and magnitudes (m, mmax: timm's scale is
# 0-10, a larger m is clipped to mmax).
_AUGMENT_BOUNDS = {"n": (1, 15), "w": (1, 16), "d": (1, 16), "m": (0, 100), "mmax": (1, 100)}


def _auto_augment_bounds(policy: str) -> str | None:
    """What is out of bounds in an ``aug.auto_augment`` policy string (``rand-m9-n2-mstd0.5``), or None; what timm
    would not parse is left to timm's own message."""
    sections: dict[str, str] = {}
    for section in policy.split("-")[1:]:
        if match := re.fullmatch(r"([a-z]+)(\d+)", section):
            sections[match[1]] = match[2]
    for key, (least, most) in _AUGMENT_BOUNDS.items():
        if key in sections and not least <= int(sections[key]) <= most:
            return f"{key}{sections[key]}: expected {key} from {least} to {most}"
    return None


def _augment_problems(cfg: ClsConfig) -> list[str]:
    """timm parses ``aug.auto_augment`` when a file dataset's transform is built: build it (no data
    needed), its counts bounded first. The tensor datasets (digits, synthetic) take no image transform."""
    if not reads_files(cfg.data):
        return []
    bound = _auto_augment_bounds(cfg.aug.auto_augment) if cfg.aug.auto_augment else None
    if bound:
        return [f"aug.auto_augment={cfg.aug.auto_augment!r}: {bound}"]
    try:
        build_transform(cfg.data, cfg.aug, is_train=True)
    except Exception as error:
        message = str(error).strip().splitlines()[0]
        return [f"aug.auto_augment={cfg.aug.auto_augment!r}: timm cannot build the training transform ({message})"]
    return []


def _memory_problems(cfg: ClsConfig) -> list[str]:
    """Inputs that cannot fit: one batch of input images alone against this machine's memory."""
    hw = cfg.input_size()
    batch = cfg.throughput.batch_size if cfg.mode == "throughput" else cfg.batch_size
    need = batch * 3 * hw[0] * hw[1] * 4
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need <= have:
        return []
    return [
        f"{cfg.input_size_key()}={hw[0]}x{hw[1]} with batch {batch}: one batch of input images alone takes "
        f"{need / 1e9:.1f} GB ({batch} x 3 x {hw[0]} x {hw[1]} x 4 bytes), more than this machine's "
        f"{have / 1e9:.1f} GB of memory"
    ]


def _split_problems(cfg: ClsConfig) -> list[str]:
    """A training run's splits are two: one split for both trains on the images it reports top-1 on."""
    data = cfg.data
    if cfg.mode == "train" and reads_files(data) and data.train_split == data.val_split:
        return [
            f"data.train_split={data.train_split} is data.val_split too: the run would train on the images it "
            "validates on and report their top-1; name two splits"
        ]
    return []


def _profile_problems(cfg: ClsConfig) -> list[str]:
    steps = cfg.profile.steps
    if steps is None:
        return []
    if len(steps) != 2 or steps[0] > steps[1]:
        return [f"profile.steps={steps}: expected [first, last], two step numbers with first <= last, e.g. [20,30]"]
    if cfg.mode != "train":
        return [f"profile.steps={steps}: only training is profiled (mode={cfg.mode}); drop it"]
    return []


def _paths_problems(cfg: ClsConfig) -> list[str]:
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
    if cfg.mode != "throughput" and (problem := data_root_problem(cfg.data)) is not None:
        problems.append(problem)
    problems += output_dir_problems(cfg.output_dir, [cfg.data.root], run_dir_for(cfg.output_dir, cfg.mode))
    if cfg.logger.wandb.mode != "disabled" and (problem := run_id_problem(run_dir_for(cfg.output_dir, cfg.mode))):
        problems.append(problem)
    return problems


@dataclasses.dataclass
class RecordedModel:
    """What builds the model a run trained, from the config its checkpoint records."""

    model: ClsModelConfig
    img_size: int | None  # the run's data.img_size (or the size asked for in its place)
    num_classes: int | None  # null for a folder dataset's run: its classifier has the count


def recorded_model_config(trained: dict[str, Any], source: str, img_size: int | None = None) -> RecordedModel:
    """The model section of a run config that the checkpoint ``source`` records
    (:func:`~cat.classification.checkpoints.recorded_config`), with its ``data.img_size`` (``img_size`` in its
    place when given) and ``data.num_classes``; a key the run predates has the value such runs had (the schema's
    ``absent_means``). A CheckpointError naming the file where a value is not one a run records (the file is the
    user's: anything may be in it)."""
    model = recorded_model_keys(trained) | {"grad_checkpointing": False}
    data = recorded if isinstance(recorded := trained.get("data"), dict) else {}
    img_size, num_classes = img_size or data.get("img_size"), data.get("num_classes")
    problems = mapping_problems(model, ClsModelConfig, "model.") + [
        problem  # of the data section's keys, these two (the others are the data's, not the model's)
        for problem in mapping_problems({"img_size": img_size, "num_classes": num_classes}, DataConfig, "data.")
        if problem.startswith(("data.img_size", "data.num_classes"))
    ]
    if "${" in repr(model):  # a recorded config is resolved: an interpolation is not a run's
        problems.append("model: holds an interpolation (${...})")
    if not problems:
        section = typed_section(ClsModelConfig, model)
        problems = _model_kwargs_problems(section)
    if problems:
        raise CheckpointError(f"{source}: its recorded run config builds no model: {'; '.join(problems)}")
    return RecordedModel(section, img_size, num_classes)


def check_config(typed: ClsConfig) -> ClsConfig:
    """Every problem with a classification config (typed and settled by
    :func:`~cat.runtime.cells.typed_job_config`, which checked it against its schema) before data or weights are
    read (ConfigError); the config when there is none.

    The rules that build things (optimizer, transform, model) only run on keys the schema passed, so one mistake is
    reported once."""
    if problems := dataset_problems(typed.data):
        raise ConfigError(problems)
    problems = _paths_problems(typed) + _optimizer_problems(typed) + _augment_problems(typed)
    problems += _profile_problems(typed) + _split_problems(typed)
    sizes = _model_kwargs_problems(typed.model)
    problems += sizes or _memory_problems(typed)
    if not sizes:
        problems += _model_problems(typed)
    if problems:
        raise ConfigError(problems)
    return typed
