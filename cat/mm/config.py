"""Hydra -> mmengine: build the Runner config for a detection or segmentation job.

The model, dataset and schedule come from the packaged OpenMMLab base configs (``mmdet::...`` /
``mmseg::...``); this module puts cat's backbone in, points the data at ``data.root``, and applies
what every cat job shares: output folder, seed, optimizer, auto-resume, W&B, and the fixes that let
the stack run on CPU and under torchrun without a GPU.
"""

from __future__ import annotations

import logging
import os
import pprint
from typing import Any

from mmengine.config import Config, ConfigDict

from cat.errors import ConfigError, DataError
from cat.models import model_kwargs
from cat.runtime.amp import amp_dtype, resolve_amp, set_tf32
from cat.runtime.dist import DistEnv
from cat.runtime.io import atomic_write_text
from cat.runtime.logger import RUN_LOGGER
from cat.runtime.resume import resumes
from cat.runtime.schema import config_record

from .backbone import backbone_features
from .bases import base_config_path
from .safe_load import ATOMIC_BACKEND, LAST_CHECKPOINT
from .schema import MMConfig, MMModelConfig

__all__ = [
    "CUSTOM_IMPORTS",
    "OWN_HOOKS_KEY",
    "RunnerConfig",
    "python_source",
    "load_base_config",
    "base_with_backbone",
    "apply_common",
    "backbone_cfg",
    "replace_sync_bn",
    "configure_loader",
    "require_data_root",
    "backbone_problems",
]


# What a saved config imports, so mmdet's and mmseg's own tools find every component it names (cat.mm.plugin); a
# user's custom_imports come after it.
CUSTOM_IMPORTS: dict[str, Any] = {"imports": ["cat.mm"], "allow_failed_imports": False}
# The +mm key that leaves cat's own hooks and metric backend out of a user's lists (not an mmengine key).
OWN_HOOKS_KEY = "cat_hooks"


class RunnerConfig(Config):
    """mmengine's ``Config``, its ``pretty_text`` formatted once for each content it has. mmengine formats the text
    with yapf each time it is read (the log, the dumped ``mm_config.py``, the runtime info, every checkpoint's meta):
    about 0.8 s each for a detector's config, which a run does not change.

    Dumped to a ``.py`` file (the run folder's ``mm_config.py``), it is the config for the stock tools: written
    atomically (:func:`python_source`), without the run's ``work_dir`` (the tools write into their ``--work-dir``, by
    default ``./work_dirs/mm_config``, never into a cat run folder) and with ``resume = False`` (``tools/train.py``
    resumes when asked, with ``--resume``). Its ``custom_imports`` (``cat.mm``) register what it names."""

    def dump(self, file: str | os.PathLike[str] | None = None) -> str | None:
        if file is None or not os.fspath(file).endswith(".py"):
            return super().dump(file)
        portable = {key: value for key, value in self.to_dict().items() if key != "work_dir"}
        atomic_write_text(os.fspath(file), python_source({**portable, "resume": False}))
        return None

    @property
    def pretty_text(self) -> str:
        content = repr(self.to_dict())
        cached = self.__dict__.get("_formatted")
        if cached is None or cached[0] != content:
            cached = (content, super().pretty_text)
            object.__setattr__(self, "_formatted", cached)  # Config's own __setattr__ would set a config key
        return cached[1]


def python_source(config: dict[str, Any], width: int = 110) -> str:
    """``config`` (plain dicts, lists, tuples and scalars) as an mmengine ``.py`` config file: one ``name = value``
    statement per top-level key, each value laid out by :mod:`pprint` within ``width`` columns and aligned under its
    opening bracket. mmengine's own ``pretty_text`` re-flows its text with yapf: about 0.8 s for a detector's
    config, on every run, for a file that reads the same."""
    statements = []
    for name, value in config.items():
        prefix = f"{name} = "
        text = pprint.pformat(value, width=max(width - len(prefix), 40), sort_dicts=False)
        statements.append(prefix + text.replace("\n", "\n" + " " * len(prefix)))
    return "\n".join(statements) + "\n"


def require_data_root(root: str | None, layout: str) -> str:
    """``root`` as an absolute path if it is a folder, else a DataError saying which ``layout`` it should hold.
    Absolute because mmengine's datasets join ``data_root`` onto their file paths, and the dumped config
    then names the data wherever it is read from."""
    if root is None or not os.path.isdir(root):
        raise DataError(f"data.root={root!r} is not a folder with the {layout}")
    return os.path.abspath(root)


def task_base(cfg: MMConfig, layout: str) -> tuple[Config, tuple[str, ...] | None, str]:
    """After checking that ``data.root`` is a folder (with the ``layout`` the message names): the
    packaged base config with cat's backbone, the class names of a subset (None: all classes), and the
    data root as an absolute path."""
    root = require_data_root(cfg.data.root, layout)
    classes = None if cfg.data.classes is None else tuple(cfg.data.classes)
    return base_with_backbone(cfg.model, cfg.strict_load), classes, root


def load_base_config(spec: str) -> Config:
    """The base config ``model.base=spec`` names (:func:`~cat.mm.bases.base_config_path`), loaded."""
    return Config.fromfile(str(base_config_path(spec)))


def _backbone_kwargs(model: MMModelConfig) -> dict[str, Any]:
    return model_kwargs(model.backbone.drop_path_rate, model.backbone.kwargs)


def backbone_cfg(model: MMModelConfig, strict_pretrained: bool = False) -> tuple[dict[str, Any], list[int]]:
    """The ``TimmBackbone`` config for ``model.backbone`` (``model.pretrained`` loaded key for key with
    ``strict_pretrained``) and its output channels."""
    kwargs = _backbone_kwargs(model)
    out_indices = list(model.backbone.out_indices)
    features = backbone_features(model.backbone.name, **kwargs)
    channels = [features[i]["num_chs"] for i in out_indices]
    cfg = {
        "type": "TimmBackbone",
        "model_name": model.backbone.name,
        "out_indices": out_indices,
        "out_norm": model.backbone.out_norm,
        "lean_attention": model.backbone.lean_attention,
        "fft_backend": model.backbone.fft_backend,
        "attention_memory_mb": model.backbone.attention_memory_mb,
        "attention_kernel": model.backbone.attention_kernel,
        "grad_checkpointing": model.backbone.grad_checkpointing,
        "pretrained": model.pretrained,
        "strict_pretrained": strict_pretrained,
        "model_kwargs": kwargs,
    }
    return cfg, channels


def _head_strides(model: ConfigDict) -> tuple[str, list[int]] | None:
    """The strides the heads are built for, and the key that holds them: a two-stage detector's RoI extractors, or
    SemanticFPN's head. None where the config names none for the backbone's levels: UperNet, and single-stage
    detectors (RetinaNet, FCOS), whose head strides cover the neck's extra levels too."""
    extractor = (model.get("roi_head") or {}).get("bbox_roi_extractor") or {}
    if (strides := extractor.get("featmap_strides")) is not None:
        return "roi_head.bbox_roi_extractor.featmap_strides", list(strides)
    strides = (model.get("decode_head") or {}).get("feature_strides")
    return None if strides is None else ("decode_head.feature_strides", list(strides))


def _has_section(config: ConfigDict, dotted: str) -> bool:
    """Whether ``config`` holds a section (a mapping) at the ``dotted`` path ('' is ``config`` itself)."""
    node: Any = config
    for name in filter(None, dotted.split(".")):
        if not isinstance(node, dict) or not isinstance(node.get(name), dict):
            return False
        node = node[name]
    return True


def backbone_problems(model: MMModelConfig) -> list[str]:
    """``model.backbone.out_indices`` name feature levels the backbone has, at the strides the heads are built
    for: mmdet and mmseg take the strides from their config, not from the maps, so maps at other strides (a
    timm ResNet's levels 0-3 are strides 2-16) train without an error and detect nothing."""
    base = load_base_config(model.base).model
    missing = [key for key in model.overrides or {} if not _has_section(base, key.rpartition(".")[0])]
    if missing:  # merged in, they would make sections without a 'type' (a KeyError in the model's build)
        sections = sorted({f"model.{key.rpartition('.')[0]}" for key in missing})
        return [
            f"model.overrides {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}: {model.base} has no "
            f"{', '.join(sections)} (overrides for another architecture, e.g. an experiment preset's: leave the "
            "preset out with '~experiment', or give model.overrides for this base)"
        ]
    name, out_indices = model.backbone.name, list(model.backbone.out_indices)
    features = backbone_features(name, **_backbone_kwargs(model))
    strides = [level["reduction"] for level in features]
    if any(i >= len(features) for i in out_indices):
        return [
            f"model.backbone.out_indices={out_indices}: {name} has {len(features)} feature levels, strides {strides}"
        ]
    # The heads as configured (the backbone's wiring does not touch them): no second build of the backbone.
    expected = _head_strides(_with_overrides(load_base_config(model.base), model).model)
    got = [strides[i] for i in out_indices]
    if expected is None or got == expected[1]:
        return []
    key, want = expected
    fitting = [strides.index(s) for s in want if s in strides]
    hint = f"; out_indices={fitting} give those" if len(fitting) == len(want) else ""
    return [
        f"model.backbone.out_indices={out_indices}: {name}'s maps there have strides {got}, but the heads are "
        f"built for strides {want} ({key}){hint}"
    ]


def base_with_backbone(model: MMModelConfig, strict_pretrained: bool = False) -> Config:
    """The packaged base config of ``model.base`` with cat's backbone wired in.

    The backbone's channels go to the FPN neck (detectors, SemanticFPN) or straight to the decode
    head (UperNet), stage 3's to an auxiliary head; ``model.overrides`` (dotted keys into the model
    config, e.g. ``{"neck.out_channels": 64}``) are applied last.
    """
    mm = load_base_config(model.base)
    backbone, channels = backbone_cfg(model, strict_pretrained)
    mm.model.backbone = ConfigDict(backbone)
    mm.model.pop("pretrained", None)  # a download URL in the packaged bases
    if mm.model.get("neck") is not None:
        mm.model.neck.in_channels = channels
    else:
        mm.model.decode_head.in_channels = channels
    if mm.model.get("auxiliary_head") is not None:
        mm.model.auxiliary_head.in_channels = channels[2]
    return _with_overrides(mm, model)


def _with_overrides(mm: Config, model: MMModelConfig) -> Config:
    """``model.overrides`` (dotted keys into the model config) applied to ``mm``."""
    if model.overrides:
        mm.merge_from_dict({f"model.{k}": v for k, v in model.overrides.items()})
    return mm


def configure_loader(loader: ConfigDict, batch_size: int, workers: int, dataset: dict[str, Any]) -> None:
    """Batch size, workers and dataset fields of one of the Runner's dataloader configs."""
    loader.batch_size = batch_size
    loader.num_workers = workers
    loader.persistent_workers = workers > 0
    loader.dataset.update(dataset)


def replace_sync_bn(node: Any) -> Any:
    """SyncBN has no CPU implementation: use plain BN (the CUDA path keeps SyncBN)."""
    if isinstance(node, dict):
        return {k: ("BN" if k == "type" and v == "SyncBN" else replace_sync_bn(v)) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(replace_sync_bn(v) for v in node)
    return node


def _clear_download_urls(node: Any) -> Any:
    """Packaged bases point at ``open-mmlab://`` / http weights; nothing is downloaded here."""
    if isinstance(node, dict):
        out = {k: _clear_download_urls(v) for k, v in node.items()}
        if out.get("type") == "Pretrained" and "://" in str(out.get("checkpoint", "")):
            return None
        if isinstance(out.get("pretrained"), str) and "://" in out["pretrained"]:
            out["pretrained"] = None
        return out
    if isinstance(node, (list, tuple)):
        return type(node)(_clear_download_urls(v) for v in node)
    return node


def apply_common(mm: Config, cfg: MMConfig, env: DistEnv, output_dir: str) -> Config:
    """Settings every cat detection/segmentation job shares."""
    mm.work_dir = output_dir
    mm.randomness = {"seed": cfg.seed, "deterministic": False}
    mm.launcher = "pytorch" if env.distributed else "none"
    mm.env_cfg = {
        "cudnn_benchmark": False,
        "mp_cfg": {"mp_start_method": "fork", "opencv_num_threads": 0},
        "dist_cfg": {"backend": "nccl" if env.device.type == "cuda" else "gloo"},
    }
    if env.distributed:
        # mmengine's default DDP wrapper passes device_ids=[local_rank], which DDP rejects on CPU.
        mm.model_wrapper_cfg = {
            "type": "MMDistributedDataParallel",
            "broadcast_buffers": False,
            "device_ids": [env.local_rank] if env.device.type == "cuda" else None,
            "find_unused_parameters": cfg.find_unused_parameters,
        }
    # checkpoint= in training: the weights a run starts from (mmengine's load_from without its resume), as in
    # classification. Once the run folder has a checkpoint the run goes on from it and reads neither that nor
    # the backbone's pretrained weights: mmengine would resume from load_from, the same file at every requeue.
    resuming = resumes(cfg, LAST_CHECKPOINT)
    mm.resume = resuming or (cfg.resume and cfg.mode == "train" and cfg.checkpoint is None)
    mm.load_from = None if resuming else cfg.checkpoint
    if resuming:
        mm.model.backbone.pretrained = None
    opt = cfg.schedule.optim
    wanted, amp_name, _ = resolve_amp(cfg.amp, env.device)
    set_tf32(cfg.amp, env.device)
    amp = wanted and env.device.type == "cuda"
    if wanted and not amp:
        logging.getLogger(RUN_LOGGER).warning(
            "amp.enabled=true: mmengine's mixed precision (AmpOptimWrapper) runs on CUDA only; this %s run trains "
            "in float32",
            env.device.type,
        )
    mm.optim_wrapper = {
        "type": "AmpOptimWrapper" if amp else "OptimWrapper",
        "optimizer": {"type": opt.type, "lr": opt.lr, "weight_decay": opt.weight_decay, "betas": list(opt.betas)},
        "paramwise_cfg": {"custom_keys": {k: {"decay_mult": 0.0} for k in opt.no_decay_keys}},
        # DDP skips the all-reduce on the inner iterations (the wrapper's optim_context: no_sync).
        "accumulative_counts": cfg.accum_steps,
    }
    if opt.clip_grad is not None:  # absent rather than None: mmdet's own clip_grad dict merges into it
        mm.optim_wrapper["clip_grad"] = {"max_norm": opt.clip_grad, "norm_type": 2}
    if amp:
        mm.optim_wrapper["dtype"] = str(amp_dtype(amp_name)).removeprefix("torch.")
    by_epoch = mm.train_cfg.get("type") == "EpochBasedTrainLoop"
    atomic = {"backend": ATOMIC_BACKEND}
    mm.default_hooks.checkpoint = {
        "type": "CheckpointHook",
        "interval": cfg.save.interval,
        "by_epoch": by_epoch,
        "max_keep_ckpts": cfg.save.keep_last,
        "save_last": True,
        "backend_args": atomic,
    }
    own_hooks: list[dict[str, Any]] = [
        {"type": "PreemptionHook", "backend_args": atomic},
        {"type": "PortableCheckpointHook"},  # checkpoints torch's weights-only loader reads (stock tools, torch.load)
        {"type": "RunConfigHook", "config": config_record(cfg)},  # what a resume compares with
    ]
    mm.custom_hooks = [*mm.get("custom_hooks", []), *own_hooks]
    mm.custom_imports = CUSTOM_IMPORTS
    # A resume loads no image of the batches it trained (mmengine's loops replay or load them).
    if by_epoch:
        mm.train_cfg["type"] = "ResumableEpochBasedTrainLoop"
        if mm.train_dataloader.sampler.type == "DefaultSampler":
            mm.train_dataloader.sampler.type = "ResumableDefaultSampler"
    elif mm.train_cfg.get("type") == "IterBasedTrainLoop":
        mm.train_cfg["type"] = "ResumableIterBasedTrainLoop"
        if mm.train_dataloader.sampler.type == "InfiniteSampler":
            mm.train_dataloader.sampler.type = "ResumableInfiniteSampler"
    # Validation metrics at their iteration, as training's: one step axis in metrics.jsonl.
    mm.default_hooks.logger = {"type": "LoggerHook", "interval": cfg.log_interval, "log_metric_by_epoch": False}
    # The run's metric sinks (metrics.jsonl, W&B), handed over when the Runner is built (cat.mm.runner).
    backends: list[dict[str, Any]] = [{"type": "MetricSinkBackend"}]
    mm.visualizer = {"type": mm.visualizer.get("type", "Visualizer"), "name": "visualizer", "vis_backends": backends}
    mm.default_hooks.visualization = {**mm.default_hooks.get("visualization", {}), "draw": False}
    if env.device.type != "cuda":
        mm.model = ConfigDict(replace_sync_bn(mm.model.to_dict()))
    mm.model = ConfigDict(_clear_download_urls(mm.model.to_dict()))
    user = {key: value for key, value in cfg.mm.items() if key != OWN_HOOKS_KEY}
    visualizer = user.get("visualizer")
    users_visualizer = isinstance(visualizer, dict) and bool(visualizer.get("_delete_"))  # the merge pops the mark
    for key, value in user.items():  # free-form overrides, mmengine's cfg-options style
        if key in ("custom_hooks", "custom_imports.imports") and not isinstance(value, (list, tuple)):
            raise ConfigError(f"mm.{key} must be a list; got {type(value).__name__} {value!r}")
        try:
            mm.merge_from_dict({key: value})
        except (TypeError, KeyError, ValueError) as error:  # mmengine's merge: what does not fit the base
            raise ConfigError(f"+mm={{{key}: ...}} does not merge into the run's config: {error}") from None
    if cfg.mm.get(OWN_HOOKS_KEY, True) is not False:
        _keep_own(mm, own_hooks, [] if users_visualizer else backends)
    imports = (mm.get("custom_imports") or {}).get("imports") or []
    mm.custom_imports = {
        "imports": list(dict.fromkeys([*CUSTOM_IMPORTS["imports"], *imports])),
        "allow_failed_imports": False,
    }
    return mm


def _keep_own(mm: Config, own_hooks: list[dict], own_backends: list[dict]) -> None:
    """cat's own hooks and metric backend added back to a user's ``custom_hooks`` and ``vis_backends`` (mmengine's
    merge puts a list in the place of the base's): without them a run would lose its preemption checkpoint, its
    portable checkpoints, its resume record and metrics.jsonl, saying nothing. A visualizer given with mmengine's
    ``_delete_: true`` is the user's whole; ``+mm={cat_hooks: false}`` leaves cat's hooks out."""
    hooks = mm.get("custom_hooks")
    if isinstance(hooks, list):
        given = {hook.get("type") for hook in hooks if isinstance(hook, dict)}
        mm.custom_hooks = [*hooks, *(hook for hook in own_hooks if hook["type"] not in given)]
    backends = mm.visualizer.get("vis_backends") if isinstance(mm.get("visualizer"), dict) else None
    if isinstance(backends, list):
        given = {backend.get("type") for backend in backends if isinstance(backend, dict)}
        mm.visualizer.vis_backends = [*backends, *(b for b in own_backends if b["type"] not in given)]
