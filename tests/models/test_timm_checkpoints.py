"""Checkpoints from timm's own train.py code path (timm.utils.CheckpointSaver: args as an argparse.Namespace,
state_dict and state_dict_ema) load into cat, as data: nothing in them runs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch
from timm.utils import CheckpointSaver, ModelEmaV3

import cat
from cat.errors import CheckpointError
from cat.models import load_checkpoint_file
from tests import prewarmed
from tests.conftest import REPO, TOY_RUN_S
from tests.hostile import _RunsCommand, _unicode, _zip_with_pickle

TINY = {"embed_dim": 32, "depth": 2, "patch_size": 8, "img_size": 32, "num_classes": 10}


@pytest.fixture
def timm_checkpoint(tmp_path) -> tuple[Path, torch.nn.Module, torch.nn.Module]:
    """What timm's train.py writes after its first epoch: model_best.pth.tar, the model and its EMA."""
    model = cat.create_model("ca_deit_tiny", **TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ema = ModelEmaV3(model, decay=0.5)
    model(torch.rand(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    ema.update(model)  # the EMA now differs from the model
    # train.py's namespace: strings, numbers, tuples, None, booleans, and the torch.device it adds.
    args = argparse.Namespace(
        model="ca_deit_tiny", lr=1e-3, epochs=15, img_size=32, mean=(0.3, 0.3, 0.3), crop_pct=None,
        no_aug=True, model_kwargs={"embed_dim": 32}, device=torch.device("cpu"),
    )  # fmt: skip
    saver = CheckpointSaver(
        model, optimizer, args=args, model_ema=ema, checkpoint_dir=str(tmp_path), recovery_dir=str(tmp_path)
    )
    saver.save_checkpoint(epoch=0, metric=42.0)
    return tmp_path / "model_best.pth.tar", model, ema.module


def test_a_timm_train_checkpoint_loads_with_its_weights_and_ema(timm_checkpoint):
    path, model, ema = timm_checkpoint
    loaded = load_checkpoint_file(path)
    assert isinstance(loaded["args"], argparse.Namespace) and loaded["args"].model == "ca_deit_tiny"
    assert loaded["args"].device == torch.device("cpu") and loaded["metric"] == 42.0
    for use_ema, source in ((False, model), (True, ema)):
        restored = cat.create_model("ca_deit_tiny", checkpoint=path, use_ema=use_ema, **TINY)
        expected = source.state_dict()
        assert restored.state_dict().keys() == expected.keys()
        assert all(torch.equal(v, expected[k]) for k, v in restored.state_dict().items())
    assert not torch.equal(model.head.weight, ema.head.weight)  # the two loads read different weights


def test_an_argparse_namespace_carries_no_code_into_a_load(tmp_path):
    """The Namespace is allowed as a bag of data: a payload among its attributes is refused like anywhere else,
    and BUILD onto the class itself (a process-wide change) is refused."""
    marker = tmp_path / "MARKER"
    payload = tmp_path / "payload.pth.tar"
    torch.save({"state_dict": {}, "args": argparse.Namespace(evil=_RunsCommand(f"touch {marker}"))}, payload)
    with pytest.raises(CheckpointError, match=r"payload.pth.tar: refused global '(posix|os).system'"):
        load_checkpoint_file(payload)
    assert not marker.exists()
    # BUILD (None, {'__repr__': 'patched'}) onto argparse.Namespace, the class.
    patch = b"\x80\x02cargparse\nNamespace\nq\x00N}(" + _unicode("__repr__") + _unicode("patched") + b"u\x86b."
    on_class = tmp_path / "build_on_class.pth.tar"
    on_class.write_bytes(_zip_with_pickle(patch))
    with pytest.raises(CheckpointError, match="build_on_class"):
        load_checkpoint_file(on_class)
    assert repr(argparse.Namespace(a=1)) == "Namespace(a=1)"


@pytest.mark.slow
def test_mode_eval_takes_a_timm_checkpoint_and_its_ema(timm_checkpoint, tmp_path):
    """train_cls.py mode=eval checkpoint=<timm's model_best.pth.tar>: the model and the EMA timm kept, each
    evaluated on the quick-start's digits."""
    path, model, _ = timm_checkpoint
    out = tmp_path / "eval"
    kwargs = [f"model.kwargs.{k}={TINY[k]}" for k in ("embed_dim", "depth", "patch_size")]
    proc = prewarmed.run(
        [sys.executable, str(REPO / "train_cls.py"), "mode=eval", f"checkpoint={path}", f"output_dir={out}",
         "logger.wandb.mode=disabled", *kwargs],
        cwd=REPO, capture_output=True, text=True, timeout=TOY_RUN_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "eval" / "metrics.json").read_text())  # an evaluation's folder
    assert metrics["eval/num_images"] == 360
    assert 0 <= metrics["eval/top1"] <= 100 and 0 <= metrics["eval/ema_top1"] <= 100
    assert metrics["checkpoint"] == str(path)
