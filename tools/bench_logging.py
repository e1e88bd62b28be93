#!/usr/bin/env python
"""What the training loop's measurements cost and whether they tell the truth, side by side in one run, on
the quick-start's model and data (a CA-DeiT of width 64 and depth 4 on scikit-learn's digits at 32x32, batch 64):

* ``logging``: median seconds per step with the interval lines and their numbers (``log_interval``, a
  :class:`~cat.runtime.meter.StepMeter`, the lines written to a log) against the bare loop (loss and lr
  only, no lines), the two alternated epoch by epoch over ``--rounds`` rounds; the overhead in %;
* ``logging, direct``: the measuring and logging alone (the meter's per-step calls, and at every 10th step its
  interval numbers, the line and the ``metrics.jsonl`` row), timed over many calls without a model, as a share
  of the bare loop's step: the A/B above cannot resolve a cost far below its noise;
* ``profiler off``: the same with a profiler window that never opens against none;
* ``data share``: a loader slowed on purpose (each image sleeps; ``--sleep-ms`` per image, or by default so
  that loading a batch takes as long as a training step) -- the share of step time the meter reports
  waiting for data against the share implied by two direct measurements: the loader alone and the steps
  alone on batches held in memory, ``load / (load + step)``.

    python tools/bench_logging.py
    python tools/bench_logging.py --rounds 9 --json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import torch
from timm.scheduler import create_scheduler_v2
from torch.utils.data import DataLoader, Dataset

import cat
from cat.classification.loops import TrainOptions, train_one_epoch
from cat.classification.state import TrainState
from cat.data.tensor_sets import digits_dataset
from cat.flops import count_macs
from cat.runtime.dist import DistEnv
from cat.runtime.logger import RUN_LOGGER
from cat.runtime.meter import StepMeter
from cat.runtime.metric_sinks import JsonlSink
from cat.runtime.profiling import ProfileWindow
from cat.toolkit import non_negative_int, positive_int

BATCH = 64


class Slowed(Dataset):
    """``base`` with each item ``seconds`` late: a slow disk or decoder."""

    def __init__(self, base: Dataset, seconds: float) -> None:
        self.base, self.seconds = base, seconds

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        time.sleep(self.seconds)
        return self.base[i]


def _state(steps: int) -> TrainState:
    torch.manual_seed(0)
    model = cat.create_model("ca_deit_tiny", embed_dim=64, depth=4, patch_size=4, img_size=32, num_classes=10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched, _ = create_scheduler_v2(opt, num_epochs=10**6, step_on_epochs=False, updates_per_epoch=steps)
    return TrainState(model, opt, sched, torch.amp.GradScaler("cpu", enabled=False))


def _epoch(state: TrainState, batches, steps: int, sink: JsonlSink, **options) -> float:
    """Seconds per step of one epoch, rows to ``sink`` (a run's metrics.jsonl) at its logged steps."""
    state.step_in_epoch = 0
    start = time.perf_counter()
    train_one_epoch(state, batches, DistEnv(), TrainOptions(steps_per_epoch=steps, log_fn=sink.log, **options))
    return (time.perf_counter() - start) / steps


def alternated(
    state: TrainState, batches, steps: int, rounds: int, sink: JsonlSink, a: dict, b: dict
) -> tuple[float, float]:
    """Median seconds per step of options ``a`` and ``b``, alternated epoch by epoch (drift hits both alike)."""
    samples: dict[str, list[float]] = {"a": [], "b": []}
    for k in range(rounds):
        order = [("a", a), ("b", b)] if k % 2 == 0 else [("b", b), ("a", a)]
        for name, options in order:
            samples[name].append(_epoch(state, batches, steps, sink, **options))
    return statistics.median(samples["a"]), statistics.median(samples["b"])


def instrumentation_cost(flops: float, history: JsonlSink, log: logging.Logger, steps: int = 5000) -> float:
    """Seconds per step of what the loop does for its interval lines, alone: the meter's calls each step and,
    every 10th, the interval's numbers, the log line and the metrics row."""
    meter = StepMeter("cpu", flops)
    start = time.perf_counter()
    for step, _ in enumerate(meter.timed(range(steps)), 1):
        meter.step_done(BATCH)
        if step % 10 == 0:
            stats = meter.interval(10, 100, 1)
            log.info("epoch 1/1 step %d/%d  %s", step, steps, "  ".join(f"{k} {v}" for k, v in stats.fields().items()))
            history.log({"train/loss_step": 1.0, "train/lr": 1e-3, **stats.metrics()}, step)
    return (time.perf_counter() - start) / steps


def measure(rounds: int, steps: int, sleep_ms: float | None, folder: str) -> list[dict[str, object]]:
    train = digits_dataset("train", img_size=32)
    batches = list(DataLoader(train, batch_size=BATCH, shuffle=True, drop_last=True))[:steps]
    steps = len(batches)
    state = _state(steps)
    log = logging.getLogger(RUN_LOGGER)
    sink = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115  (the lines are written, to nowhere)
    log.addHandler(sink)
    log.setLevel(logging.INFO)
    history = JsonlSink(os.path.join(folder, "metrics.jsonl"))
    flops = 6.0 * count_macs(state.model, torch.zeros(1, 3, 32, 32))
    rows: list[dict[str, object]] = []
    with_lines, bare = alternated(
        state,
        batches,
        steps,
        rounds,
        history,
        {"meter": StepMeter("cpu", flops), "log_interval": 10},
        {"meter": None, "log_interval": 10**9},
    )
    rows.append(
        {"row": "logging", "with_s": with_lines, "without_s": bare, "overhead_pct": 100 * (with_lines / bare - 1)}
    )
    rows.append({"row": "logging, direct", "cost_s": instrumentation_cost(flops, history, log), "step_s": bare})
    rows[-1]["overhead_pct"] = 100 * rows[-1]["cost_s"] / bare
    never = ProfileWindow(10**9, 10**9, os.devnull, torch.device("cpu"), 0, log, 1)
    window, bare = alternated(state, batches, steps, rounds, history, {"profiler": never}, {"profiler": None})
    rows.append({"row": "profiler off", "with_s": window, "without_s": bare, "overhead_pct": 100 * (window / bare - 1)})

    step_s = bare
    per_image = sleep_ms / 1e3 if sleep_ms is not None else step_s / BATCH
    slowed = DataLoader(Slowed(train, per_image), batch_size=BATCH, shuffle=False, drop_last=True)
    start, loaded = time.perf_counter(), 0
    for _ in zip(range(steps), slowed, strict=False):
        loaded += 1
    load_s = (time.perf_counter() - start) / loaded
    shares: list[float] = []
    monitor = StepMeter("cpu", flops)
    opts = {"meter": monitor, "log_interval": max(1, min(5, steps // 2))}
    for _ in range(max(1, rounds // 2)):
        recorded: list[dict] = []
        state.step_in_epoch = 0
        train_one_epoch(
            state,
            slowed,
            DistEnv(),
            TrainOptions(steps_per_epoch=steps, log_fn=lambda m, _s, rows=recorded: rows.append(m), **opts),
        )
        shares += [r["train/data_share"] for r in recorded[1:]]  # the first interval holds the epoch's warm-up
    log.removeHandler(sink)
    history.finish()
    implied = load_s / (load_s + step_s)
    reported = statistics.median(shares) if shares else None
    rows.append(
        {
            "row": "data share",
            "sleep_ms_per_image": 1e3 * per_image,
            "loader_s_per_batch": load_s,
            "step_s_in_memory": step_s,
            "implied_share": implied,
            "reported_share": reported,
            "difference_points": None if reported is None else 100 * (reported - implied),
        }
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=positive_int, default=5, help="epochs of each variant, alternated")
    parser.add_argument("--steps", type=positive_int, default=22, help="steps per epoch (the quick-start has 22)")
    parser.add_argument("--sleep-ms", type=float, default=None, help="data share: ms per image (default: a step's)")
    parser.add_argument("--threads", type=non_negative_int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        rows = measure(args.rounds, args.steps, args.sleep_ms, folder)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows[:3]:
        if "cost_s" in row:
            print(
                f"{row['row']:<16} {1e6 * row['cost_s']:8.1f} us/step of a {1e3 * row['step_s']:.1f} ms step: "
                f"{row['overhead_pct']:.3f} %"
            )
            continue
        print(
            f"{row['row']:<16} {1e3 * row['with_s']:8.2f} ms/step with, {1e3 * row['without_s']:8.2f} without: "
            f"{row['overhead_pct']:+.2f} %"
        )
    share = rows[3]
    reported = "none" if share["reported_share"] is None else f"{100 * share['reported_share']:.1f} %"
    load, step = 1e3 * share["loader_s_per_batch"], 1e3 * share["step_s_in_memory"]
    print(
        f"data share       loader {load:.1f} ms/batch, step {step:.1f} ms: "
        f"implied {100 * share['implied_share']:.1f} %, reported {reported}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
