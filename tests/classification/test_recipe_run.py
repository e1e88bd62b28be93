"""The shape of a user's first real run: the paper's DeiT recipe (aug=deit: RandAugment, random
erasing, mixup/cutmix) on a folder of ImageNet-sized JPEGs, with real DataLoader workers."""

from __future__ import annotations

import json
import sys

import pytest

from tests import prewarmed
from tests.conftest import REPO, TOY_RUN_S

pytestmark = pytest.mark.slow


def test_deit_recipe_on_a_jpeg_folder(toy_imagenet, tmp_path):
    out = tmp_path / "run"
    command = [
        sys.executable,
        str(REPO / "train_cls.py"),
        "data=folder",
        f"data.root={toy_imagenet}",
        "aug=deit",
        "epochs=3",
        "workers=2",
        "batch_size=32",
        "model.kwargs={embed_dim:32,depth:2,patch_size:16}",
        "logger.wandb.mode=disabled",
        f"output_dir={out}",
    ]
    proc = prewarmed.run(command, cwd=REPO, capture_output=True, text=True, timeout=TOY_RUN_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["epoch"] == 3 and 0.0 <= metrics["val/top1"] <= 100.0
    log = (out / "log.txt").read_text()
    assert "300 train / 60 val images, 6 classes" in log
    assert sum(line.count("epoch ") and "train loss" in line for line in log.splitlines()) == 3
