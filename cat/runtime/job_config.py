"""The config sections every cat job has (``train_cls.py``, ``train_det.py``, ``train_seg.py``), declared in the
key language of :mod:`cat.runtime.schema`: :class:`JobConfig` and its sections, and :class:`NetworkConfig`, the keys
that build a network in every task. Classification (``cat.classification.schema``) and detection/segmentation
(``cat.mm.schema``) extend them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .schema import FIXED, FREE, RECIPE, key, section

__all__ = [
    "AmpConfig",
    "SaveConfig",
    "NetworkConfig",
    "ClusterConfig",
    "WandbConfig",
    "LoggerConfig",
    "JobConfig",
]


@dataclass
class AmpConfig:
    enabled: Literal["auto", True, False] = key(
        "mixed precision (autocast) for training and evaluation; auto: on CUDA (as the authors train), not on a CPU",
        absent_means=False,
    )
    dtype: Literal["auto", "bf16", "fp16"] = key(
        "the autocast dtype; auto: bf16 where the device supports it, else fp16 (fp16 adds a gradient scaler on CUDA)",
        absent_means="bf16",
    )
    tf32: bool = key(
        "TF32 tensor cores for float32 matmuls and convolutions on CUDA (what autocast leaves in float32: circulant "
        "attention's spectral projection among them); no effect on a CPU",
        resume=FREE,  # the same math, rounded another way
        absent_means=False,
    )


@dataclass
class SaveConfig:
    keep_last: int = key("periodic snapshots kept besides the last (and, for classification, the best)", min=0)


@dataclass
class NetworkConfig:
    """The keys that build a network in every task (a classifier, a detector's or segmenter's backbone); each task's
    model section extends it."""

    name: str = key("a registered model: cat's (ca_deit_tiny, ca_pvt_small, ...) or any timm model")
    drop_path_rate: float | None = key(
        "stochastic depth; null: the model factory's value", min=0, max=1, absent_means=None
    )
    kwargs: dict[str, Any] = key(
        "extra model arguments, checked against the model's, e.g. {embed_dim: 64}", absent_means={}
    )
    lean_attention: Literal["auto", True, False] = key(
        "what circulant attention keeps for its backward: false (its spectra: the faster), true (only its input, "
        "recomputing the rest: the least memory), auto (the spectra while a 24-block model's would fit "
        "attention_memory_mb, else the lean function; cat.ops.policy)",
        resume=FREE,  # the same math, computed another way
        absent_means="auto",
    )
    fft_backend: Literal["auto", "fft", "separable", "matmul"] = key(
        "circulant attention's 2-D DFTs: fft (torch.fft, float32), separable (two GEMMs per transform, in autocast's "
        "dtype: tensor cores), matmul (one dense GEMM: small grids, ONNX), auto (separable on CUDA under fp16/bf16 "
        "autocast, else fft)",
        resume=FREE,  # the same math, computed another way
        absent_means="auto",
    )
    attention_kernel: Literal["auto", "triton", "aten"] = key(
        "how circulant attention runs: triton (one Triton kernel each way, its interpreter on a CPU), aten (torch's "
        "operators: the DFTs, the softmax and the products one after another), auto (triton on CUDA where the grid "
        "fits on chip, unless tools/gpu_check.py measured aten faster there or the kernels fail their first check; "
        "cat.ops.policy.kernel_for)",
        resume=FREE,  # the same math, computed another way
        absent_means="auto",
    )
    attention_memory_mb: int | None = key(
        "MiB circulant attention may use: the lean function's working set per block, and what auto lets a "
        "24-block model's stored spectra take; null: a quarter of the device's free memory at the first step",
        min=1,
        max=2**40,
        resume=FREE,
        absent_means=None,
    )
    grad_checkpointing: bool = key(
        "recompute each block's activations in the backward (timm's set_grad_checkpointing)", resume=FREE
    )


@dataclass
class ClusterConfig:
    partition: str | None = key("Slurm partition (hydra/launcher=slurm)")
    account: str | None = key("Slurm account")
    constraint: str | None = key("Slurm node constraint")
    time_min: int = key("minutes per job; near it the cell saves and submitit requeues it", min=1)
    nodes: int = key("nodes per job", min=1)
    gpus_per_node: int = key("GPUs per node (0 on a CPU partition)", min=0)
    tasks_per_node: int = key("processes per node: one per GPU (1 on a CPU partition)", min=1)
    cpus_per_task: int = key("CPU cores per process", min=1)
    mem_gb: int | None = key("memory per node in GB; null: the partition's default", min=1)
    max_requeues: int = key("how many times a preempted or timed-out job is requeued", min=0)


@dataclass
class WandbConfig:
    mode: Literal["auto", "online", "offline", "disabled"] = key(
        "auto: online with an API key, else offline (and online falls back to offline when W&B's server is "
        "unreachable); disabled: no W&B (metrics.jsonl is always written)",
        in_run_name=False,
    )
    # W&B's limits: another value fails W&B's init, or the sync of an offline run
    project: str = key("W&B project", length=(1, 128), forbid="/\\#?%:", in_run_name=False)
    entity: str | None = key("W&B entity (team or user); null: the key's default", in_run_name=False)
    tags: list[str] = key("W&B run tags", length=(1, 64))
    name: str = key("W&B run name (in a multirun the cell's folder name is added: <name>/<the cell's overrides>)")
    group: str | None = key(
        "W&B run group; null: a multirun's cells are grouped by sweep_name, other runs not", in_run_name=False
    )


@dataclass
class LoggerConfig:
    wandb: WandbConfig = section(WandbConfig, "Weights & Biases, one run per output_dir (resumed with it)")


@dataclass
class RunConfig:
    confine: bool = key(
        "the kernel confines the run's writes (Landlock, Linux 5.13+) to output_dir, the temporary folder, /dev, the "
        "stack's caches and may_write; false: only cat's own checks of the options it knows",
        absent_means=False,
    )
    may_write: list[str] = key("more folders a confined run may write in, e.g. [/scratch/shared]", absent_means=[])


@dataclass
class JobConfig:
    """The keys every cat job (train_cls.py, train_det.py, train_seg.py) has, with one meaning each."""

    name: str = key("run name: names output_dir and the W&B run", length=(1, 255))
    mode: Literal["train", "eval"] = key("train, or eval a checkpoint")
    output_dir: str = key("the run folder: config, log, checkpoints, metrics.json(l); eval/ for mode=eval")
    checkpoint: str | None = key("eval: the weights to evaluate; training: the weights a run starts from")
    resume: bool = key("continue from output_dir's last checkpoint when there is one")
    strict_load: bool = key(
        "checkpoint= (and a backbone's model.pretrained=) must match the model key for key; false: load what fits"
    )
    seed: int = key("random seed (each rank and epoch derives its own)", min=0, max=2**31 - 1, resume=FIXED)
    debug: bool = key("user errors keep their traceback (as HYDRA_FULL_ERROR=1)", in_run_name=False)
    device: Literal["auto", "cuda", "cpu"] = key("auto: CUDA when available", in_run_name=False)
    amp: AmpConfig = section(AmpConfig, "mixed precision", resume=RECIPE)
    workers: int = key("data-loading processes per training process", min=0, in_run_name=False)
    dist_timeout_s: int = key(
        "seconds a rank waits for the others in a collective before it fails (a lost node ends the job after it); "
        "longer than anything one rank does alone (saving, COCO evaluation)",
        min=1,
        max=7 * 24 * 3600,
        in_run_name=False,
    )
    log_interval: int = key("steps between console and metric log lines", min=1, in_run_name=False)
    save: SaveConfig = section(SaveConfig, "checkpoints")
    sweep_name: str = key(
        "multirun (-m): the sweep's folder, outputs/<task>/sweeps/<sweep_name>/<cell>", in_run_name=False
    )
    cluster: ClusterConfig = section(
        ClusterConfig, "Slurm resources, read by hydra/launcher=slurm (submitit)", in_run_name=False
    )
    logger: LoggerConfig = section(LoggerConfig, "metric sinks besides output_dir/metrics.jsonl")
    run: RunConfig = section(RunConfig, "where the run may write (cat.runtime.confine)", in_run_name=False)
