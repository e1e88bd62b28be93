"""The metrics of a classification run, declared once: what each is, how a split's value is computed, how the
console shows it and how it is summarised over a run.

Each metric has one name everywhere: ``<split>/<name>``, the split being ``train``, ``val`` (each epoch) or ``eval``
(``mode=eval``), in ``metrics.json``, ``metrics.jsonl`` and W&B alike (:func:`split_names`); the log line shows it
under its split (:func:`console_text`).
Adding an evaluation metric is one :data:`EVAL_METRICS` entry and its per-batch computation: :func:`evaluate`, the
epoch's log line and every record follow the table. Runs written before these names kept ``top1``, ``best_top1``,
``ema_top1``, ``val_loss`` and ``train_loss`` in ``metrics.json``; the tools that read runs read those too
(:data:`cat.toolkit.runs.RUN_METRICS`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cat.runtime.amp import Precision
from cat.runtime.console import progress_bar
from cat.runtime.dist import DistEnv, all_reduce_sum

__all__ = [
    "EvalMetric",
    "EVAL_METRICS",
    "BEST",
    "EMA",
    "evaluate",
    "split_names",
    "console_text",
]


@dataclass(frozen=True)
class EvalMetric:
    """One metric of a split: ``batch_total(logits, targets)`` is a batch's sum (a float64 scalar), the split's value
    ``scale`` times the sum over every image of every rank, divided by the images."""

    name: str
    doc: str
    batch_total: Callable[[Tensor, Tensor], Tensor]
    scale: float = 1.0
    console: str = "{:.2f}"  # its format in the log line


def _top_k(k: int) -> Callable[[Tensor, Tensor], Tensor]:
    def hits(logits: Tensor, targets: Tensor) -> Tensor:
        top = logits.topk(min(k, logits.shape[1]), dim=1).indices  # fewer classes than k: every class
        return top.eq(targets[:, None]).any(dim=1).sum().double()

    return hits


def _cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits, targets, reduction="sum").double()


EVAL_METRICS: tuple[EvalMetric, ...] = (
    EvalMetric("top1", "top-1 accuracy (%)", _top_k(1), scale=100),
    EvalMetric("top5", "top-5 accuracy (%)", _top_k(5), scale=100),
    EvalMetric("loss", "mean cross-entropy", _cross_entropy, console="{:.4f}"),
)
# How a run is summarised: the best validation top-1 over its epochs (its weights are best.pth), and the top-1 of
# its weight EMA where it keeps one.
BEST, EMA = "best_top1", "ema_top1"


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[tuple[Tensor, Tensor]],
    env: DistEnv,
    precision: Precision,
    steady_s: list[float] | None = None,
) -> dict[str, float]:
    """Each of :data:`EVAL_METRICS` over the whole split, summed across ranks, by name, and ``num_images``.
    ``steady_s``: gets what the evaluation takes once warm, its batches after the first timed and scaled to all of
    them (a compiled model compiles its evaluation graph in the first)."""
    model.eval()
    totals = torch.zeros(len(EVAL_METRICS) + 1, dtype=torch.float64, device=env.device)  # the metrics, the images
    started, after_first, batches = time.perf_counter(), 0.0, 0
    for images, targets in progress_bar(loader, "eval", env.is_main):
        batches += 1
        if batches == 2:
            after_first = time.perf_counter()
        images = precision.inputs(images)
        targets = targets.to(env.device, non_blocking=True)
        with precision.autocast():
            logits = model(images)
        logits = logits.float()
        count = torch.tensor(float(len(targets)), dtype=torch.float64, device=env.device)
        totals += torch.stack([*(metric.batch_total(logits, targets) for metric in EVAL_METRICS), count])
    all_reduce_sum(totals)
    if steady_s is not None:
        ended = time.perf_counter()
        steady_s.append((ended - after_first) * batches / (batches - 1) if batches > 1 else ended - started)
    images = totals[-1].clamp(min=1)
    values = {
        metric.name: (metric.scale * total / images).item()
        for metric, total in zip(EVAL_METRICS, totals[:-1], strict=True)
    }
    return {**values, "num_images": int(totals[-1].item())}


def split_names(split: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` under their names in a run's records: ``<split>/<name>``."""
    return {f"{split}/{name}": value for name, value in values.items()}


def console_text(values: Mapping[str, float]) -> str:
    """The evaluation metrics for a log line, in the table's order and formats: ``top1 76.54 top5 93.21 ...``."""
    return " ".join(f"{m.name} {m.console.format(values[m.name])}" for m in EVAL_METRICS if m.name in values)
