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
