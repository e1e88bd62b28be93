"""The classification config (``train_cls.py``): its typed sections, one dataclass each, every fact
about a key on its declaration (:func:`~cat.runtime.schema.key`). The ``data`` and ``aug`` sections are
declared beside the datasets (:mod:`cat.data.config`); the checks that need the model, the optimizer or
the machine are :mod:`cat.classification.checks`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from cat.data import AugConfig, DataConfig
from cat.runtime.job_config import JobConfig, NetworkConfig
from cat.runtime.schema import FIXED, FREE, GROW, RECIPE, key, register_schema, section

__all__ = [
    "ClsConfig",
    "ClsModelConfig",
    "OptimConfig",
    "ScheduleConfig",
    "EmaConfig",
    "ThroughputConfig",
    "ProfileConfig",
    "Scheduler",
]

# timm's per-step schedulers (plateau needs a metric at every step, which the trainer does not give)
Scheduler = Literal["cosine", "tanh", "step", "multistep", "poly", "constant", "wsd", "rsqrt"]


@dataclass
class ClsModelConfig(NetworkConfig):
    """The ``model`` section: the network a run builds (:func:`~cat.classification.model_building.build_model`)."""

    convert: dict[str, Any] | None = key(
        "cat.convert a timm ViT/Swin/PVT v2 to circulant attention: {} (defaults), {stages: [0, 1]}, ...",
        absent_means=None,
    )

    # The settings that make a run's weights another model's (a checkpoint's mismatch names them).
    DEFINING_KEYS = ("name", "kwargs", "convert")


@dataclass
class OptimConfig:
    """The ``optim`` section: timm's optimizer (:func:`~cat.classification.optimization.build_train_state`)."""

    opt: str = key("any timm optimizer name (timm.optim.list_optimizers())", resume=FIXED)
    weight_decay: float = key("none on norms, biases and the model's no_weight_decay()", min=0)
    kwargs: dict[str, Any] = key("passed to the optimizer as is, checked against its arguments")
    momentum: float = key("for momentum optimizers", min=0)
    clip_grad: float | None = key("max gradient norm; null: no clipping", min=0, exclusive_min=True)
    lr_base_batch: int | None = key("lr is scaled by global_batch / lr_base_batch; null: lr as given", min=1)


@dataclass
class ScheduleConfig:
    sched: Scheduler = key("timm scheduler, updated every step")
    warmup_epochs: float = key("linear warm-up from warmup_lr", min=0)
    warmup_lr: float = key("lr at the start of warm-up", min=0)
    min_lr: float = key("the schedule's floor", min=0)
    cooldown_epochs: float = key("epochs at min_lr after the schedule", min=0)


@dataclass
class EmaConfig:
    enabled: bool = key(
        "keep an exponential moving average of the weights (evaluated as ema_top1, saved as model_ema)", resume=FIXED
    )
    decay: float = key("EMA decay per step", min=0, max=1)


@dataclass
class ThroughputConfig:
    batch_size: int = key("images per forward", min=1)
    img_size: int | None = key("null: data.img_size", min=1)
    warmup: int = key("untimed forwards first", min=0)
    iters: int = key("timed forwards", min=1)


@dataclass
class ProfileConfig:
    steps: list[int] | None = key(
        "[first, last]: record torch.profiler over these optimizer steps of rank 0 (counted from 1 over the run, "
        "as metrics.jsonl's step) into output_dir/profile; null: off",
        min=1,
    )
    top: int = key("operators in the log's table of the window's most expensive ones", min=1)


@dataclass
class ClsConfig(JobConfig):
    # Every job's modes and one more: the type widens JobConfig's (a section is read, never assigned through a
    # JobConfig), which the checker would refuse for an attribute in general.
    mode: Literal["train", "eval", "throughput"] = key(  # type: ignore[assignment]
        "train, eval a checkpoint, or measure throughput"
    )
    # A resume may change anything but what makes it another run (FIXED): the model, the data, the recipe's
    # augmentation, batch, seed, optimizer and whether there is an EMA. The recipe (RECIPE) applies from the
    # resumed step on.
    model: ClsModelConfig = section(ClsModelConfig, "the network", resume=FIXED)
    data: DataConfig = section(DataConfig, "the dataset", resume=FIXED)
    aug: AugConfig = section(AugConfig, "training augmentation (timm's)", resume=FIXED)
    optim: OptimConfig = section(OptimConfig, "the optimizer (timm's)", resume=RECIPE)
    schedule: ScheduleConfig = section(ScheduleConfig, "the learning-rate schedule (timm's)", resume=RECIPE)
    epochs: int = key("training epochs", min=1, max=100_000, resume=GROW)
    batch_size: int = key(
        "images per process and forward; the global batch is batch_size x world x accum_steps", min=1, resume=FIXED
    )
    accum_steps: int = key("forwards (micro-batches) per optimizer step, gradients accumulated", min=1, resume=FIXED)
    lr: float = key(
        "peak learning rate at a global batch of optim.lr_base_batch",
        min=0,
        max=1e6,
        exclusive_min=True,
        resume=RECIPE,
    )
    compile: Literal["auto", True, False] = key(
        "torch.compile the model's forward and backward; auto: on CUDA (a small model's eager step costs what its "
        "operators cost the host to issue), eager on a CPU; the log's first lines say which and why",
        absent_means=False,
    )
    compile_mode: Literal["auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = key(
        "torch.compile's mode: reduce-overhead (and max-autotune) replay the step as CUDA graphs on a GPU, for "
        "steps of one shape (training drops the last partial batch); auto: reduce-overhead on CUDA, else default",
        in_run_name=False,
    )
    compile_fullgraph: bool = key(
        "compiling makes one graph of the model: a graph break is an error that names it (false: allowed); with "
        "model.lean_attention=true relaxed, and the log says so (the lean function runs outside the graph)",
        in_run_name=False,
    )
    channels_last: bool = key("channels-last memory format")
    ema: EmaConfig = section(EmaConfig, "weight EMA", resume=RECIPE)
    checkpoint_ema: bool = key(
        "take checkpoint='s weight EMA (model_ema) instead of its model weights: to start training or measure "
        "throughput (mode=eval evaluates both without it)"
    )
    pin_memory: bool = key("pinned host memory for CUDA input copies")
    deterministic: bool = key("torch.use_deterministic_algorithms (slower; CPU resumes are bit-exact without it)")
    throughput: ThroughputConfig = section(ThroughputConfig, "mode=throughput")
    profile: ProfileConfig = section(ProfileConfig, "a profiler window (mode=train)", resume=FREE, in_run_name=False)

    def input_size_key(self) -> str:
        """The key that sets the input size: throughput.img_size when throughput mode sets one."""
        return "throughput.img_size" if self.mode == "throughput" and self.throughput.img_size else "data.img_size"

    def input_size(self) -> tuple[int, int]:
        """The (height, width) the run feeds its model."""
        size = (
            self.throughput.img_size if self.mode == "throughput" and self.throughput.img_size else self.data.img_size
        )
        return size, size


register_schema("cls", ClsConfig)
