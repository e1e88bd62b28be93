"""Everything a classification run trains and counts, as one object that saves and restores itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from timm.utils import ModelEmaV3
from torch import nn

from cat.models import extract_state_dict

__all__ = ["TrainState"]


@dataclass
class TrainState:
    """Model, optimizer, scheduler, scaler, EMA, and where training is.

    ``epoch`` is the epoch in progress (0-based; equal to the epochs finished) and ``step_in_epoch``
    the optimizer steps it has done. ``train_model`` is what the loop calls (``model`` compiled
    and/or wrapped in DDP); ``model`` is what is saved.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # a timm scheduler
    scaler: torch.amp.GradScaler
    ema: ModelEmaV3 | None = None
    epoch: int = 0
    step_in_epoch: int = 0
    best_top1: float | None = None
    wall_time_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    # Gradients accumulate in buffers allocated once and cleared in place (a CUDA-graph step's accumulation).
    stable_grads: bool = False
    train_model: nn.Module = field(init=False)

    def __post_init__(self) -> None:
        self.train_model = self.model

    def global_step(self, steps_per_epoch: int) -> int:
        return self.epoch * steps_per_epoch + self.step_in_epoch

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint entries of the release format; its ``epoch`` is the last finished epoch
        (0-based, -1 for none), so a mid-epoch checkpoint holds ``epoch - 1`` and ``step_in_epoch``."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            # The EMA model's own weights, under the name DeiT's checkpoints and timm's loader use.
            "model_ema": self.ema.module.state_dict() if self.ema is not None else None,
            "epoch": self.epoch - 1,
            "step_in_epoch": self.step_in_epoch,
            "best_top1": self.best_top1,
            "metrics": self.metrics,
            "wall_time_s": self.wall_time_s,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from a checkpoint. The optimizer keeps its moments and step counts but takes its
        hyper-parameters (lr, weight decay, betas) from the current config; the scheduler is not
        restored: it is a pure function of the step, rebuilt from the current config."""
        self.model.load_state_dict(state["model"])
        saved = state["optimizer"]
        groups = saved["param_groups"]
        if len(groups) == len(self.optimizer.param_groups):  # else torch's own error says so
            # The current settings loaded with the moments: torch places a fused or capturable step's counts on the
            # parameters' device by the groups it loads (a CPU checkpoint's would stay on the CPU, beside a CUDA
            # run's fused AdamW).
            groups = [
                {**{k: v for k, v in current.items() if k != "params"}, "params": group["params"]}
                for group, current in zip(groups, self.optimizer.param_groups, strict=True)
            ]
        self.optimizer.load_state_dict({**saved, "param_groups": groups})
        self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None:
            self.ema.module.load_state_dict(extract_state_dict(state, "the checkpoint", use_ema=True))
        self.epoch, self.step_in_epoch = state["epoch"] + 1, state["step_in_epoch"]
        self.best_top1, self.wall_time_s, self.metrics = state["best_top1"], state["wall_time_s"], state["metrics"]
