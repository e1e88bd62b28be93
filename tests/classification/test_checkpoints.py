"""Checkpoint rotation touches only its own run folder's files, whatever the folder is called."""

from __future__ import annotations

import glob
import os

from cat.classification.checkpoints import CheckpointManager, epoch_snapshots
from cat.classification.job import run
from tests.conftest import TINY_CLS, compose_config


def _other_run(tmp_path):
    other = tmp_path / "run0"
    other.mkdir()
    (other / "epoch_0007.pth").write_bytes(b"another run's snapshot")
    return other / "epoch_0007.pth"


def test_rotation_uses_the_folder_name_literally(tmp_path):
    victim = _other_run(tmp_path)
    folder = tmp_path / "run?"
    folder.mkdir()
    # What the rotation used to list: a glob over the folder's name reaches run0.
    assert glob.glob(os.path.join(folder, "epoch_*.pth")) == [str(victim)]
    manager = CheckpointManager(str(folder), keep_last=1)
    for epoch in (1, 2, 3):
        manager.save({"epoch": epoch, "model": {}})
    assert victim.exists()
    assert sorted(os.listdir(folder)) == ["epoch_0003.pth", "last.pth"]
    assert epoch_snapshots(str(folder)) == [str(folder / "epoch_0003.pth")]


def test_training_run_in_a_glob_named_folder(tmp_path):
    victim = _other_run(tmp_path)
    out = tmp_path / "run?"
    run(compose_config("cls", *TINY_CLS, "epochs=3", f"output_dir='{out}'"))
    assert victim.exists() and (out / "last.pth").is_file() and len(epoch_snapshots(str(out))) == 1


def test_a_cpu_checkpoint_resumed_by_a_cuda_run_gives_fused_adamw_its_steps_on_the_device():
    """torch places a fused (or capturable) AdamW's step counts by the groups it loads: a checkpoint of a CPU run's
    plain AdamW would leave them on the host beside a CUDA run's fused one. The resumed state loads with the current
    settings, so they land on the parameters' device (fake CUDA tensors: no GPU needed)."""
    import torch
    from timm.scheduler import create_scheduler_v2
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cat.classification.state import TrainState
    from cat.toolkit.fake_cuda import fake_cuda_module

    def state_of(model: torch.nn.Module, **kwargs) -> TrainState:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, **kwargs)
        schedule, _ = create_scheduler_v2(optimizer, sched="constant", num_epochs=1, updates_per_epoch=2)
        return TrainState(model, optimizer, schedule, torch.amp.GradScaler("cpu", enabled=False))

    cpu = state_of(torch.nn.Linear(4, 3))
    cpu.model(torch.randn(2, 4)).sum().backward()
    cpu.optimizer.step()
    saved = cpu.state_dict()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = torch.nn.Linear(4, 3)
        fake_cuda_module(model, mode)
        cuda = state_of(model, fused=True)
        cuda.load_state_dict(saved)
    steps = [entry["step"] for entry in cuda.optimizer.state.values()]
    assert len(steps) == 2 and all(step.device.type == "cuda" for step in steps)
    assert cuda.optimizer.param_groups[0]["fused"] is True
