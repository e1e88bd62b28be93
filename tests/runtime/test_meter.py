"""The interval numbers of a training run (cat.runtime.meter), its memory readings, the GPU peak table and the
profiler window, through the real training loop on a tiny model."""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import re
import time
from pathlib import Path

import pytest
import torch
from timm.scheduler import create_scheduler_v2
from torch import nn
from torch.utils.data import DataLoader, Dataset

from cat.classification.loops import TrainOptions, train_one_epoch
from cat.classification.state import TrainState
from cat.runtime.dist import DistEnv
from cat.runtime.hardware import peak_of_device_name, peak_tflops
from cat.runtime.memory import reset_peak_memory
from cat.runtime.meter import WARMUP_STEPS, IntervalStats, StepMeter
from cat.runtime.profiling import ProfileWindow

REPO = Path(__file__).resolve().parents[2]
STATS = [f"train/{f.name}" for f in dataclasses.fields(IntervalStats)]


class SlowImages(Dataset):
    """Random images that take ``seconds`` each to read: a loader slowed on purpose."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.seconds)
        return torch.randn(3, 2, 2), i % 3


def _state(steps: int) -> TrainState:
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched, _ = create_scheduler_v2(opt, num_epochs=3, step_on_epochs=False, updates_per_epoch=steps)
    return TrainState(model, opt, sched, torch.amp.GradScaler("cpu", enabled=False))


def _train(batches, steps: int, meter: StepMeter | None, interval: int, **options) -> list[tuple[int, dict]]:
    rows: list[tuple[int, dict]] = []
    opts = TrainOptions(
        steps_per_epoch=steps,
        num_epochs=3,
        log_interval=interval,
        meter=meter,
        log_fn=lambda metrics, step: rows.append((step, metrics)),
        **options,
    )
    train_one_epoch(_state(steps), batches, DistEnv(), opts)
    return rows


def test_every_row_carries_the_declared_keys_and_no_guessed_mfu():
    flops = 1e9
    rows = _train([(torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,)))] * 6, 6, StepMeter("cpu", flops), 3)
    assert [step for step, _ in rows] == [3, 6]
    for _, row in rows:
        assert list(row) == ["train/loss_step", "train/lr", *STATS]
        row = {k.removeprefix("train/"): v for k, v in row.items()}
        assert row["mfu"] is None and row["mem_reserved_mib"] is None  # a CPU: no listed peak, no allocator
        assert row["tflops"] == flops * row["img_s"] / 1e12
        assert row["img_s_global"] == row["img_s"] and 0 <= row["data_share"] <= 1
    # Without a meter, a row is the loss and the lr, as before.
    assert [list(row) for _, row in _train([(torch.randn(4, 3, 2, 2), torch.zeros(4).long())] * 2, 2, None, 1)] == [
        ["train/loss_step", "train/lr"]
    ] * 2


def test_a_slowed_loader_shows_as_data_time_and_warns_once(caplog):
    per_image, batch = 0.05, 2  # a 100 ms wait per step: data-bound even on a loaded machine
    loader = DataLoader(SlowImages(18, per_image), batch_size=batch)
    with caplog.at_level(logging.WARNING, logger="cat.train"):
        rows = _train(loader, 9, StepMeter("cpu", advice="Try workers=8."), 3)
    for _, row in rows:
        # time.sleep sleeps at least as long as asked: each step waited that long for its batch, at least
        assert row["train/data_s"] >= batch * per_image and row["train/step_s"] >= row["train/data_s"]
        assert row["train/data_share"] > 0.5  # the tiny model's step is a fraction of the wait
    warnings = [r.getMessage() for r in caplog.records if "data-bound" in r.getMessage()]
    # The first interval holds the epoch's warm-up (the loader starting): the warning comes from the second.
    assert len(warnings) == 1 and "epoch 1 steps 4-6" in warnings[0] and warnings[0].endswith("Try workers=8.")
    with caplog.at_level(logging.WARNING, logger="cat.train"):
        caplog.clear()
        _train([(torch.randn(2, 3, 2, 2), torch.zeros(2).long())] * 9, 9, StepMeter("cpu"), 3)
    assert not [r for r in caplog.records if "data-bound" in r.getMessage()]


def test_the_time_left_counts_the_run_steps_left():
    rows = _train([(torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,)))] * 8, 8, StepMeter("cpu"), 2)
    by_step = dict(rows)
    assert by_step[2]["train/eta_s"] is None  # only warm-up steps so far: no mean to extrapolate
    # Epoch 1 of 3, step 4 of 8: 4 steps left in it, 4 + 2 x 8 in the run, all at the same running mean.
    assert by_step[4]["train/eta_s"] == pytest.approx(by_step[4]["train/epoch_eta_s"] * 20 / 4)
    assert by_step[8]["train/epoch_eta_s"] == 0 and by_step[8]["train/eta_s"] > 0
    assert WARMUP_STEPS < 4


def test_memory_growth_between_lines_is_seen():
    if not reset_peak_memory("cpu"):
        pytest.skip("this OS cannot reset a process's peak resident set")
    meter = StepMeter("cpu")
    meter.step_done(1)
    meter.interval(1, 1, 1)
    # 256 MiB of new pages, touched, then freed: fresh anonymous memory (an allocator's own free memory, resident
    # from an earlier test in this worker, would not raise the peak)
    held = mmap.mmap(-1, 256 * 2**20)
    for offset in range(0, len(held), mmap.PAGESIZE):
        held[offset] = 1
    held.close()
    meter.step_done(1)
    stats = meter.interval(1, 1, 1)
    assert stats.mem_growth_mib >= 200 and stats.mem_peak_mib >= 200
    meter.step_done(1)
    assert meter.interval(1, 1, 1).mem_growth_mib < 100  # the next line starts from what is held then


def test_gpu_peaks_are_listed_or_null():
    assert peak_of_device_name("NVIDIA H200", "bf16") == 989.4
    assert peak_of_device_name("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_of_device_name("NVIDIA A10", "bf16") == 125.0 and peak_of_device_name("NVIDIA A100-SXM4-80GB", "bf16")
    assert peak_of_device_name("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 on a V100
    # Every card the docs name has a peak for what a run computes in on it (no null MFU on a common card).
    for name, dtype in [
        ("Tesla V100-SXM2-32GB", "fp16"),
        ("Tesla V100-PCIE-16GB", "fp16"),
        ("Tesla T4", "fp16"),
        ("NVIDIA A100-SXM4-80GB", "bf16"),
        ("NVIDIA H100 80GB HBM3", "bf16"),
        ("NVIDIA H200", "bf16"),
        ("NVIDIA L4", "bf16"),
        ("NVIDIA L40S", "bf16"),
        ("NVIDIA GeForce RTX 3090", "bf16"),
        ("NVIDIA GeForce RTX 4090", "bf16"),
    ]:
        assert peak_of_device_name(name, dtype) is not None, name
    assert peak_of_device_name("NVIDIA L4", "bf16") != peak_of_device_name("NVIDIA L40S", "bf16")
    assert peak_of_device_name("NVIDIA GeForce GTX 1080", "fp32") is None  # not listed: null, never a guess
    assert peak_tflops(torch.device("cpu"), "fp32") is None


def test_a_profile_window_writes_a_trace_and_a_table(tmp_path, caplog):
    window = ProfileWindow(2, 3, str(tmp_path), torch.device("cpu"), 0, logging.getLogger("cat.train"), top=5)
    batches = [(torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,)))] * 5
    with caplog.at_level(logging.INFO, logger="cat.train"):
        _train(batches, 5, None, 5, profiler=window)
    trace = json.loads((tmp_path / "profile" / "steps_2-3" / "rank0.pt.trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::addmm" in names  # the Linear layer's forward, recorded
    (message,) = [r.getMessage() for r in caplog.records if "profile of steps" in r.getMessage()]
    assert message.startswith("profile of steps 2-3 (rank 0)") and "Self CPU" in message
    # A window the run ends inside keeps what it recorded, named for the steps it holds.
    cut = ProfileWindow(4, 9, str(tmp_path), torch.device("cpu"), 0, logging.getLogger("cat.train"), top=5)
    _train(batches, 5, None, 5, profiler=cut)
    cut.close()
    assert (tmp_path / "profile" / "steps_4-9" / "rank0.pt.trace.json").is_file()


def test_the_classification_page_documents_every_key():
    readme = (REPO / "docs" / "classification.md").read_text()
    documented = set(re.findall(r"^\| `(train/\w+)` \|", readme, flags=re.M))
    assert set(STATS) <= documented, set(STATS) - documented
