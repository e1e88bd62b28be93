"""Nothing an mmengine checkpoint or run folder holds runs code or deletes files through cat.

Each payload is first shown to fire through the library call it targets (a marker file appears),
then to do nothing through cat's entry points (det and seg auto-resume, ``checkpoint=`` resume
and evaluation, URLs and model-zoo names)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cat.errors import CheckpointError
from tests import prewarmed
from tests.conftest import REPO, TOY_RUN_S, refusal_line, run_folder
from tests.hostile import write_hostile_files
from tests.mm.conftest import run_entry

pytestmark = pytest.mark.slow  # end-to-end runs: `pytest -m "not slow"` leaves them out

pytest.importorskip("mmdet", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")

FAST = ["logger.wandb.mode=disabled", "log_interval=1", "batch_size=2"]
TOY = {"det": ("train_det.py", "toy_mask_rcnn_ca_pvt"), "seg": ("train_seg.py", "toy_fpn_ca_pvt")}
LOOPBACK_URL = "http://127.0.0.1:9/models"  # never contacted: the file is already in the cache


def _entry(task: str, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    script, experiment = TOY[task]
    return prewarmed.run(
        [sys.executable, str(REPO / script), f"experiment={experiment}", *FAST, *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TOY_RUN_S,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def trained(toy_coco, toy_ade, tmp_path_factory) -> dict[str, tuple[Path, Path, Path]]:
    """One epoch/iteration window of each toy task: (run folder, its checkpoint, data root)."""
    runs = {}
    for task, root in (("det", toy_coco), ("seg", toy_ade)):
        out = tmp_path_factory.mktemp(f"trained_{task}")
        length = ["schedule.epochs=1"] if task == "det" else ["schedule.iters=2", "save.interval=2"]
        run_entry(TOY[task][0], f"experiment={TOY[task][1]}", f"data.root={root}", f"output_dir={out}", *FAST, *length)
        pointer = (out / "last_checkpoint").read_text().strip()
        runs[task] = (out, Path(pointer), root)
    return runs


def _hostile_copy(source: Path, folder: Path, marker: Path) -> Path:
    """``source`` (a real mmengine checkpoint) with a config that runs ``touch marker``, in ``folder``
    with ``last_checkpoint`` naming it, as mmengine's own auto-resume would find it."""
    from cat.mm.safe_load import load_from_safe_local

    run_folder(folder)
    checkpoint = load_from_safe_local(str(source))
    checkpoint["meta"]["config"] = f"x = __import__('os').system('touch {marker}')\n"
    checkpoint["meta"]["cfg"] = checkpoint["meta"]["config"]
    path = folder / source.name
    torch.save(checkpoint, path)
    (folder / "last_checkpoint").write_text(str(path))
    return path


@pytest.mark.parametrize("task", ["det", "seg"])
def test_checkpoint_config_never_runs(task, trained, tmp_path):
    from mmengine.config import Config

    out, checkpoint, root = trained[task]
    marker = tmp_path / "MARKER"
    hostile = _hostile_copy(checkpoint, tmp_path / "run", marker)
    # What Runner.resume does with it: Config.fromstring executes the text.
    Config.fromstring(torch.load(hostile, weights_only=False)["meta"]["config"], file_format=".py")
    assert marker.exists()
    marker.unlink()
    # Auto-resume from the run folder, then checkpoint= resume into a fresh folder, then evaluation.
    more = ["schedule.epochs=2"] if task == "det" else ["schedule.iters=4", "save.interval=2"]
    proc = _entry(task, f"data.root={root}", f"output_dir={tmp_path / 'run'}", *more)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed" in (proc.stdout + proc.stderr).lower() and not marker.exists()
    proc = _entry(task, f"data.root={root}", f"output_dir={tmp_path / 'other'}", f"checkpoint={hostile}", *more)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not marker.exists()
    proc = _entry(task, f"data.root={root}", f"output_dir={tmp_path / 'eval'}", "mode=eval", f"checkpoint={hostile}")
    assert proc.returncode == 0 and not marker.exists(), proc.stderr[-3000:]


def test_sanitizer_keeps_what_mmengine_needs_and_drops_the_rest(trained, tmp_path):
    from cat.mm.safe_load import MM_META_EXECUTED, load_from_safe_local, sanitize_mm_checkpoint

    out, checkpoint, _ = trained["det"]
    legit = load_from_safe_local(str(checkpoint))
    assert {"epoch", "iter", "seed"} <= set(legit["meta"])  # mmengine's own file keeps its loop state
    assert not set(legit["meta"]) & MM_META_EXECUTED
    assert legit["message_hub"]["runtime_info"]["keep_ckpt_ids"]
    victim = tmp_path / "victim.pth"
    victim.write_bytes(b"x")
    hostile = {
        "meta": {"epoch": 1, "iter": 4, "config": "boom", "cfg": "boom", "hook_msgs": {}},
        "message_hub": {
            "runtime_info": {
                "best_ckpt": str(victim),  # CheckpointHook deletes the previous best on a new best
                "best_ckpt_coco/bbox_mAP": str(checkpoint.parent / "best_coco_bbox_mAP_epoch_1.pth"),
                "keep_ckpt_ids": ["../x"],
                "epoch": 1,
            }
        },
        "param_schedulers": [{"optimizer": "not a state", "last_epoch": 3}],
    }
    clean = sanitize_mm_checkpoint(hostile, str(checkpoint))
    assert clean["meta"] == {"epoch": 1, "iter": 4, "hook_msgs": {}}  # the executed config gone, data kept
    assert clean["message_hub"]["runtime_info"] == {
        "best_ckpt_coco/bbox_mAP": str(checkpoint.parent / "best_coco_bbox_mAP_epoch_1.pth"),
        "epoch": 1,
    }
    assert clean["param_schedulers"] == [{"last_epoch": 3}]
    with pytest.raises(CheckpointError, match="meta.epoch"):
        sanitize_mm_checkpoint({"meta": {"epoch": "1; rm"}}, "x.pth")


@pytest.fixture
def cached_hostile(tmp_path) -> tuple[dict[str, str], Path, Path]:
    """A hostile file sitting in torch's hub cache (TORCH_HOME) under the name a URL points at."""
    marker = tmp_path / "MARKER"
    files = write_hostile_files(tmp_path / "files", marker)
    home = tmp_path / "torch_home"
    (home / "hub" / "checkpoints").mkdir(parents=True)
    shutil.copy(files["zip_torch"], home / "hub" / "checkpoints" / "evil.pth")
    return {"TORCH_HOME": str(home)}, marker, files["zip_torch"]


def test_url_payload_fires_through_torch_hub(cached_hostile):
    env, marker, _ = cached_hostile
    code = f"from mmengine.runner.checkpoint import load_from_http; load_from_http('{LOOPBACK_URL}/evil.pth')"
    prewarmed.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, timeout=300)
    assert marker.exists()


def test_every_scheme_ends_in_cats_loader(cached_hostile, monkeypatch):
    from mmengine.runner.checkpoint import CheckpointLoader

    from cat.mm import safe_load

    env, marker, _ = cached_hostile
    monkeypatch.setenv("TORCH_HOME", env["TORCH_HOME"])
    safe_load.install_safe_checkpoint_io()
    loaders = {prefix: loader.__module__ for prefix, loader in CheckpointLoader._schemes.items()}
    assert set(loaders.values()) == {safe_load.__name__}, loaders
    with pytest.raises(CheckpointError, match="refusing to load checkpoint .*evil.pth.*system"):
        CheckpointLoader.load_checkpoint(f"{LOOPBACK_URL}/evil.pth")
    for name in ("pavi://model.pth", "s3://bucket/model.pth"):
        with pytest.raises(CheckpointError, match=name.split("//")[0]):
            CheckpointLoader.load_checkpoint(name)
    # torchvision://resnet50 names resnet50-0676ba61.pth: a substitute in the cache fails its hash.
    cache = Path(env["TORCH_HOME"]) / "hub" / "checkpoints"
    shutil.copy(cache / "evil.pth", cache / "resnet50-0676ba61.pth")
    with pytest.raises(CheckpointError, match="hash check"):
        CheckpointLoader.load_checkpoint("torchvision://resnet50")
    assert not marker.exists()


def test_url_entry_points_refuse(cached_hostile, trained, tmp_path):
    env, marker, _ = cached_hostile
    out, _, root = trained["det"]
    proc = _entry(
        "det",
        f"data.root={root}",
        f"output_dir={tmp_path / 'eval'}",
        "mode=eval",
        f"checkpoint={LOOPBACK_URL}/evil.pth",
        env=env,
    )
    assert "refusing to load checkpoint" in refusal_line(proc)
    run = run_folder(tmp_path / "run")
    (run / "last_checkpoint").write_text(f"{LOOPBACK_URL}/evil.pth")
    proc = _entry("det", f"data.root={root}", f"output_dir={run}", "schedule.epochs=2", env=env)
    last = refusal_line(proc)
    assert "last_checkpoint" in last and "not a checkpoint file in this run folder" in last
    assert not marker.exists()


def test_eval_with_weights_that_match_nothing_is_refused(trained, tmp_path):
    out, checkpoint, root = trained["det"]
    foreign = tmp_path / "foreign.pth"
    torch.save({"state_dict": {"backbone.foo.weight": torch.zeros(3)}, "meta": {}}, foreign)
    proc = _entry("det", f"data.root={root}", f"output_dir={tmp_path / 'eval'}", "mode=eval", f"checkpoint={foreign}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"checkpoint {foreign} does not match the model" in proc.stderr
    assert "unexpected in checkpoint (1): backbone.foo.weight" in proc.stderr
    assert not (tmp_path / "eval" / "eval" / "metrics.json").exists()
    proc = _entry(
        "det",
        f"data.root={root}",
        f"output_dir={tmp_path / 'eval'}",
        "mode=eval",
        f"checkpoint={foreign}",
        "strict_load=false",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
