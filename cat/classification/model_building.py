"""A classification run's model from its ``model`` section: created, converted, its weights loaded, placed."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

import cat
from cat.errors import ConfigError
from cat.models import (
    CheckpointMismatchError,
    extract_state_dict,
    load_checkpoint_file,
    load_weights,
    model_arguments,
    model_kwargs,
)
from cat.ops import CirculantAttention, configure_attention, describe
from cat.ops.policy import lean_decisions
from cat.runtime import DistEnv, Precision, amp_dtype, resolve_amp
from cat.runtime.resume import resumes

from .checkpoints import LAST, recorded_config, recorded_model_keys
from .schema import ClsConfig, ClsModelConfig

__all__ = [
    "build_model",
    "model_differences",
    "build_train_model",
    "CompilePlan",
    "compile_plan",
    "compiled",
    "lean_blocks",
]


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
    return configure_attention(
        model,
        model_cfg.lean_attention,
        model_cfg.fft_backend,
        model_cfg.attention_memory_mb,
        model_cfg.attention_kernel,
    )


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
    trained = recorded_model_keys(trained_config)
    return [
        f"model.{key}={trained[key]!r} where this model has {getattr(model_cfg, key)!r}"
        for key in ClsModelConfig.DEFINING_KEYS
        if trained[key] != getattr(model_cfg, key)
    ]


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


# torch.compile's modes that replay the step as CUDA graphs.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class CompilePlan:
    """How a run compiles its model (:func:`compile_plan`): ``mode`` None is eager."""

    mode: str | None
    fullgraph: bool
    why: str
    stable_grads: bool = False  # gradients accumulate in buffers allocated once and cleared in place
    compile_ddp: bool = False  # the DDP-wrapped module is compiled (dynamo's DDP optimizer splits it at buckets)

    def line(self) -> str:
        """The log line that says it."""
        if self.mode is None:
            return f"eager: {self.why}"
        graph = "one graph" if self.fullgraph else "graph breaks allowed"
        return f"compiled (torch.compile, mode {self.mode}, {graph}): {self.why}"


def compile_plan(cfg: ClsConfig, device: torch.device, world_size: int = 1, lean_blocks: int = 0) -> CompilePlan:
    """Whether and how a run on ``device`` compiles its model: ``compile=auto`` compiles on CUDA, where an eager
    step of a small model costs what its operators cost the host to issue, and stays eager on a CPU, where
    compiling costs more than it saves; ``compile_mode=auto`` replays the step as CUDA graphs on CUDA. Lean
    circulant attention runs outside the graph, so fullgraph is relaxed for it: ``model.lean_attention=true``, or
    ``auto`` where ``lean_blocks`` blocks go lean by the memory rule (:func:`lean_blocks`). Under CUDA graphs,
    accumulated gradients live in stable buffers; with ``world_size`` > 1 the DDP module is compiled, so that
    dynamo's DDP optimizer splits the graph at gradient buckets and their all-reduces overlap the backward."""
    if cfg.compile == "auto":
        if device.type != "cuda":
            return CompilePlan(None, False, f"compile=auto on {device.type} (compiles on CUDA only)")
        why = "compile=auto on cuda"
    elif not cfg.compile:
        return CompilePlan(None, False, "compile=false")
    else:
        why = "compile=true"
    mode = cfg.compile_mode
    if mode == "auto":
        mode = "reduce-overhead" if device.type == "cuda" else "default"
        why += f", compile_mode=auto: {'CUDA graphs' if mode == 'reduce-overhead' else 'no CUDA graphs off CUDA'}"
    fullgraph = cfg.compile_fullgraph
    if fullgraph and cfg.model.lean_attention is True:
        fullgraph = False
        why += "; fullgraph relaxed: lean_attention=true runs the lean function outside the graph"
    elif fullgraph and lean_blocks:
        fullgraph = False
        why += (
            f"; fullgraph relaxed: lean_attention=auto takes the lean function for {lean_blocks} attention blocks "
            "(their stored spectra would pass the memory budget), which run outside the graph"
        )
    stable_grads = mode in CUDA_GRAPH_MODES and cfg.accum_steps > 1
    if stable_grads:
        why += (
            f"; accum_steps={cfg.accum_steps} under CUDA graphs: gradients accumulate in buffers allocated once and "
            "cleared in place (a CUDA graph's output kept as .grad would be overwritten by the next replay)"
        )
    compile_ddp = world_size > 1
    if compile_ddp:
        fullgraph = False
        why += (
            f"; {world_size} processes: the DDP module is compiled, so the graph splits at gradient buckets and each "
            "bucket's all-reduce overlaps the rest of the backward (DDP's own forward runs between graphs)"
        )
    return CompilePlan(mode, fullgraph, why, stable_grads, compile_ddp)


def compiled(plan: CompilePlan, model: nn.Module) -> nn.Module:
    """``model`` under torch.compile as ``plan`` says, else ``model`` itself."""
    if plan.mode is None:
        return model
    return cast(nn.Module, torch.compile(model, mode=plan.mode, fullgraph=plan.fullgraph))


def lean_blocks(model: nn.Module, batch: tuple[int, ...], precision: Precision) -> int:
    """How many attention blocks of ``model`` take the lean function (:func:`cat.ops.policy.lean_for`) in a training
    forward of images shaped ``batch`` under ``precision``: one forward on tensors without data, which computes
    nothing (in eval mode, so no running statistic moves; with gradients, so each block takes the path training takes:
    the choice reads only sizes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    training = model.training
    try:
        with (
            FakeTensorMode(allow_non_fake_inputs=True),
            lean_decisions() as decisions,
            precision.autocast(),
        ):
            model.eval()(torch.empty(batch, device=precision.device))
    finally:
        model.train(training)
    return sum(decision.lean for decision in decisions)


def attention_plan(cfg: ClsConfig, env: DistEnv, model: nn.Module) -> str | None:
    """The log line that says what ``model``'s circulant attention takes on this run's device and precision, and
    why (:func:`cat.ops.describe`); None for a model without it."""
    if not any(isinstance(m, CirculantAttention) or hasattr(m, "fft_backend") for m in model.modules()):
        return None
    enabled, amp_name, _ = resolve_amp(cfg.amp, env.device)
    dtype = amp_dtype(amp_name) if enabled else next(model.parameters()).dtype
    model_cfg = cfg.model
    plan = describe(
        env.device, dtype, model_cfg.lean_attention, model_cfg.fft_backend, model_cfg.attention_memory_mb,
        model_cfg.attention_kernel,
    )  # fmt: skip
    return plan + ("; compiled" if compile_plan(cfg, env.device).mode is not None else "")
