"""The training loop's guards, checkpoint atomicity and RNG capture, at function level."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from timm.scheduler import create_scheduler_v2
from torch import nn

from cat.classification.checkpoints import CheckpointManager
from cat.classification.loops import NonFiniteLossError, TrainOptions, optimizer_steps, train_one_epoch, train_step
from cat.classification.state import TrainState
from cat.runtime import capture_rng_state, restore_rng_state
from cat.runtime.dist import DistEnv
from cat.runtime.io import atomic_save


class NaNOnStep(nn.Module):
    """A criterion that turns non-finite on a given call."""

    def __init__(self, bad_call: int) -> None:
        super().__init__()
        self.calls, self.bad_call = 0, bad_call

    def forward(self, logits, targets):
        self.calls += 1
        loss = nn.functional.cross_entropy(logits, targets)
        return loss * float("nan") if self.calls == self.bad_call else loss


def test_non_finite_loss_stops_naming_the_step():
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched, _ = create_scheduler_v2(opt, num_epochs=1, step_on_epochs=False, updates_per_epoch=5)
    data = [(torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,))) for _ in range(5)]
    before = [p.detach().clone() for p in model.parameters()]
    state = TrainState(model, opt, sched, torch.amp.GradScaler("cpu", enabled=False), epoch=7, step_in_epoch=1)
    # A resumed epoch: 0-based epoch 7 is the log's epoch 8, which had done 1 of its 6 steps; the third
    # step of this call is the epoch's 4th (1-based, as logged) and global step 7 * 6 + 4 = 46.
    with pytest.raises(NonFiniteLossError, match=r"epoch 8, step 4 \(global step 46\)"):
        train_one_epoch(state, data, DistEnv(), TrainOptions(criterion=NaNOnStep(3), steps_per_epoch=6))
    # Two good steps were taken and counted, the bad one was not applied.
    assert state.step_in_epoch == 3
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_atomic_save_leaves_old_file_on_failure(tmp_path):
    path = str(tmp_path / "last.pth")
    atomic_save({"v": torch.ones(2)}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        atomic_save({"v": Unpicklable()}, path)
    assert torch.equal(torch.load(path, weights_only=True)["v"], torch.ones(2))
    assert os.listdir(tmp_path) == ["last.pth"]  # no temporary left behind


def test_manager_keeps_last_k_and_best(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_last=2)
    for epoch in range(4):
        entries = {"model": {"w": torch.tensor(float(epoch))}, "optimizer": {}, "scheduler": {}, "config": {}}
        mgr.save({**entries, "epoch": epoch, "step_in_epoch": 0}, is_best=epoch == 1)
    assert sorted(os.listdir(tmp_path)) == ["best.pth", "epoch_0002.pth", "epoch_0003.pth", "last.pth"]
    assert torch.load(tmp_path / "best.pth", weights_only=True)["epoch"] == 1
    assert mgr.load_last()["epoch"] == 3


def test_rng_state_round_trips_through_weights_only_checkpoint(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    atomic_save({"rng": capture_rng_state()}, str(tmp_path / "rng.pth"))
    expected = (random.random(), np.random.rand(), torch.rand(1))
    restore_rng_state(torch.load(tmp_path / "rng.pth", weights_only=True)["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def _tiny_state(steps: int, ema: bool = False) -> TrainState:
    from timm.utils import ModelEmaV3

    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched, _ = create_scheduler_v2(opt, num_epochs=2, warmup_epochs=0, step_on_epochs=False, updates_per_epoch=steps)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return TrainState(model, opt, sched, scaler, ModelEmaV3(model, decay=0.5) if ema else None)


def test_train_step_advances_what_moves_with_a_step():
    state = _tiny_state(steps=4, ema=True)
    images, targets = torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,))
    lr_before, ema_before = state.optimizer.param_groups[0]["lr"], state.ema.module[1].weight.clone()
    step = train_step(state, [(images, targets)], TrainOptions(steps_per_epoch=4))
    assert state.step_in_epoch == 1 and step.batch == 4 and not step.stop and not step.loss.requires_grad
    assert state.optimizer.param_groups[0]["lr"] < lr_before  # the cosine schedule moved one step
    assert not torch.equal(state.ema.module[1].weight, ema_before)


def test_epoch_is_its_steps():
    """train_one_epoch is train_step over the batches plus accounting: same weights, mean loss."""
    torch.manual_seed(0)
    data = [(torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,))) for _ in range(3)]
    by_epoch, by_steps = _tiny_state(3), _tiny_state(3)
    by_steps.model.load_state_dict(by_epoch.model.state_dict())
    result = train_one_epoch(by_epoch, data, DistEnv(), TrainOptions(steps_per_epoch=3))
    losses = [train_step(by_steps, [(x, y)], TrainOptions(steps_per_epoch=3)).loss for x, y in data]
    for a, b in zip(by_epoch.model.parameters(), by_steps.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert result.steps == 3 and result.loss == pytest.approx(float(torch.stack(losses).mean()))


def test_a_stop_request_ends_the_epoch_after_the_running_step():
    data = [(torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,))) for _ in range(5)]
    state = _tiny_state(5)
    result = train_one_epoch(state, data, DistEnv(), TrainOptions(steps_per_epoch=5, stop_requested=lambda: True))
    assert result.interrupted and result.steps == 1 and state.step_in_epoch == 1


def _tiny_circulant_state(lr: float = 0.5) -> TrainState:
    import cat

    torch.manual_seed(0)
    model = cat.create_model("ca_deit_tiny", img_size=16, embed_dim=16, depth=1, patch_size=4, num_classes=3)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched, _ = create_scheduler_v2(opt, sched="constant", num_epochs=1, warmup_epochs=0, updates_per_epoch=4)
    return TrainState(model, opt, sched, torch.amp.GradScaler("cpu", enabled=False))


@pytest.mark.parametrize("accum", [2, 4])
def test_accumulated_step_equals_one_large_batch(accum):
    """accum_steps micro-batches of B/accum give the step one batch of B gives (a CA-DeiT, SGD)."""
    images, targets = torch.randn(8, 3, 16, 16), torch.randint(0, 3, (8,))
    large, accumulated = _tiny_circulant_state(), _tiny_circulant_state()
    train_step(large, [(images, targets)], TrainOptions(steps_per_epoch=4))
    micro = list(zip(images.chunk(accum), targets.chunk(accum), strict=True))
    step = train_step(accumulated, micro, TrainOptions(steps_per_epoch=4, accum_steps=accum))
    assert step.batch == 8 and accumulated.step_in_epoch == 1
    for (name, a), b in zip(large.model.named_parameters(), accumulated.model.parameters(), strict=True):
        assert not torch.equal(a, _tiny_circulant_state().model.get_parameter(name)), name  # the step moved it
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6, msg=name)
    assert all(p.grad is None for p in accumulated.model.parameters())  # nothing carried into the next step


def test_optimizer_steps_groups_and_leaves_out_an_incomplete_group():
    batches = iter(range(11))
    assert list(optimizer_steps(batches, 3, steps=10)) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert list(optimizer_steps(range(11), 3, steps=2)) == [[0, 1, 2], [3, 4, 5]]


def test_a_stop_never_splits_an_accumulated_step():
    """A stop asked for during the first micro-batch ends the epoch after that step's last one."""
    data = iter([(torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,))) for _ in range(9)])
    state = _tiny_state(3)
    opts = TrainOptions(steps_per_epoch=3, accum_steps=3, stop_requested=lambda: True)
    result = train_one_epoch(state, data, DistEnv(), opts)
    assert result.interrupted and result.steps == 1 and state.step_in_epoch == 1
    assert result.progress.images == 12 and len(list(data)) == 6  # three micro-batches used, six left


def test_ddp_all_reduces_once_per_accumulated_step(tmp_path):
    """DDP skips the all-reduce on the inner micro-batches (no_sync): an accumulated step makes as
    many all-reduce calls as a plain one (a real process group, gloo, one rank)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        calls = []

        def counting_hook(_, bucket):
            calls.append(bucket.index())
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        state = _tiny_state(4)
        state.train_model = DistributedDataParallel(state.model)
        state.train_model.register_comm_hook(None, counting_hook)
        batch = (torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,)))
        train_step(state, [batch], TrainOptions(steps_per_epoch=4))
        plain = len(calls)
        calls.clear()
        train_step(state, [batch] * 3, TrainOptions(steps_per_epoch=4, accum_steps=3))
        assert plain >= 1 and len(calls) == plain
    finally:
        dist.destroy_process_group()


def test_logging_every_interval_at_the_global_step():
    data = [(torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,))) for _ in range(4)]
    state = _tiny_state(4)
    state.epoch = 1
    logged = []
    opts = TrainOptions(steps_per_epoch=4, log_interval=2, log_fn=lambda m, s: logged.append((s, sorted(m))))
    train_one_epoch(state, data, DistEnv(), opts)
    assert logged == [(6, ["train/loss_step", "train/lr"]), (8, ["train/loss_step", "train/lr"])]


def _fused_state(steps: int, seed: int = 0) -> TrainState:
    """A state whose AdamW is fused (CPU has the kernel too): it skips a step on a device flag, as a CUDA run's does."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    sched, _ = create_scheduler_v2(opt, num_epochs=2, warmup_epochs=0, step_on_epochs=False, updates_per_epoch=steps)
    return TrainState(model, opt, sched, torch.amp.GradScaler("cpu", enabled=False))


def test_a_step_whose_optimizer_takes_a_device_flag_reads_nothing_of_the_device():
    """With fused AdamW the loop reads no device value in a step (no .item(), no bool() of a step tensor: each is a
    wait for the GPU on CUDA): it reads a host copy of the step before's flags. An optimizer without the flag has its
    step's flags read before it steps."""
    from cat.classification.loops import StepChecks, skips_on_device
    from cat.toolkit.dispatch import KernelCounter

    data = [(torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,))) for _ in range(4)]
    reads = {}
    for name, state in (("fused", _fused_state(4)), ("plain", _tiny_state(4))):
        checks = StepChecks(deferred=skips_on_device(state.optimizer))
        train_step(state, [data[0]], TrainOptions(steps_per_epoch=4), checks)  # the first step, outside the count
        with KernelCounter() as counter:
            for batch in data[1:]:
                train_step(state, [batch], TrainOptions(steps_per_epoch=4), checks)
        reads[name] = counter.counts["aten._local_scalar_dense"] + counter.counts["aten.is_nonzero"]
    assert reads == {"fused": 0, "plain": 6}  # plain: the two flags of each of the 3 steps


@pytest.mark.parametrize("bad", ["loss", "gradients"])
def test_a_non_finite_step_is_skipped_on_the_device_and_named_a_step_late(bad):
    """Deferred checks: step 3's non-finite loss (or a finite loss whose gradients overflow) is skipped by the fused
    step and raised during step 4, naming step 3; the weights are step 2's, as a run that read at once leaves them."""
    data = [(torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,))) for _ in range(6)]

    class Bad(nn.Module):
        calls = 0

        def forward(self, logits, targets):
            Bad.calls += 1
            loss = nn.functional.cross_entropy(logits, targets)
            return loss * float("nan") if Bad.calls == 3 else loss

    class Overflow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * float("inf")

    class BadGradients(nn.Module):
        calls = 0

        def forward(self, logits, targets):
            BadGradients.calls += 1
            out = Overflow.apply(logits) if BadGradients.calls == 3 else logits
            return nn.functional.cross_entropy(out, targets)

    criterion = Bad() if bad == "loss" else BadGradients()
    states = {}
    for name, state in (("deferred", _fused_state(6)), ("at once", _fused_state(6))):
        state.optimizer._step_supports_amp_scaling = name == "deferred"  # the one difference: when the host reads
        with pytest.raises(NonFiniteLossError, match=rf"non-finite {bad}.*epoch 1, step 3 \(global step 3\)"):
            train_one_epoch(state, data, DistEnv(), TrainOptions(criterion=criterion, steps_per_epoch=6))
        criterion.calls = 0
        type(criterion).calls = 0
        states[name] = state
    for a, b in zip(states["deferred"].model.parameters(), states["at once"].model.parameters(), strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_an_evaluation_is_priced_warm_for_the_time_left():
    """The ETA prices the evaluations to come at a warm one's time: the first batch of an evaluation (where a compiled
    model compiles its graph) is left out and the rest scaled to every batch."""
    import time

    from cat.classification.metrics import evaluate
    from cat.runtime import Precision

    class CompilesFirst(nn.Module):
        calls = 0

        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(12, 3)

        def forward(self, x):
            CompilesFirst.calls += 1
            time.sleep(0.5 if CompilesFirst.calls == 1 else 0.01)
            return self.linear(x.flatten(1))

    data = [(torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,))) for _ in range(5)]
    steady: list[float] = []
    started = time.perf_counter()
    evaluate(CompilesFirst(), data, DistEnv(), Precision(torch.device("cpu")), steady)
    whole = time.perf_counter() - started
    assert len(steady) == 1 and 0.04 <= steady[0] < 0.3 < whole
