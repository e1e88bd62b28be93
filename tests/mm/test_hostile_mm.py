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
from cat.runtime.confine import abi_version
from cat.runtime.metric_sinks import read_history
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


def test_a_component_named_by_an_import_path_is_refused_with_nothing_run(toy_coco, tmp_path):
    """mmengine's registry would import ``os.system`` and the runner call it with the hook's options."""
    marker = tmp_path / "MARKER"
    hook = f"{{type: os.system, command: 'touch {marker}'}}"
    proc = _entry("det", f"data.root={toy_coco}", f"output_dir={tmp_path / 'run'}", f"+mm={{custom_hooks: [{hook}]}}")
    assert "mm.custom_hooks[0].type='os.system': not a component the OpenMMLab registries hold" in refusal_line(proc)
    assert not marker.exists()


# A hook of the user's own, registered through custom_imports, that writes where its option (named as no path is)
# says: what no early check can know.
_OUTSIDE_WRITER = """
from mmengine.hooks import Hook
from mmengine.registry import HOOKS


@HOOKS.register_module()
class OutsideWriter(Hook):
    def __init__(self, target):
        self.target = target

    def before_train(self, runner):
        with open(self.target, "w") as f:
            f.write("written by the hook")
"""


@pytest.mark.skipif(abi_version() < 1, reason="this kernel has no Landlock")
def test_a_write_no_check_knows_is_stopped_by_the_kernel_in_one_line(toy_coco, tmp_path, outside_dir):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "outside_writer.py").write_text(_OUTSIDE_WRITER)
    outside = outside_dir
    planted = outside / "planted.txt"
    planted.write_text("theirs")
    hook = f"{{type: OutsideWriter, target: {planted}}}"
    option = f"+mm={{custom_imports: {{imports: [outside_writer]}}, custom_hooks: [{hook}]}}"
    args = ["det", f"data.root={toy_coco}", f"output_dir={tmp_path / 'run'}", "schedule.epochs=1", option]
    proc = _entry(*args, env={"PYTHONPATH": str(plugins)})
    assert refusal_line(proc) == (
        f"error: the run may not write {planted}: a run writes only in its output_dir, the temporary folder and the "
        f"stack's caches (run.confine); to allow that folder: run.may_write=[{outside}]"
    )
    assert planted.read_text() == "theirs"
    proc = _entry(*args, f"run.may_write=[{outside}]", "resume=false", env={"PYTHONPATH": str(plugins)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert planted.read_text() == "written by the hook"


def test_cats_record_and_checkpoints_survive_a_users_hooks_and_backends(toy_coco, tmp_path):
    """An OpenMMLab user's lists (mmdet's own NumClassCheckHook, a local backend) are added to cat's: the metric
    record, the portable checkpoints and the resume record are still written, and the log lists what runs."""
    run = tmp_path / "run"
    users = "{custom_hooks: [{type: NumClassCheckHook}], visualizer: {vis_backends: [{type: LocalVisBackend}]}}"
    proc = _entry("det", f"data.root={toy_coco}", f"output_dir={run}", "schedule.epochs=1", f"+mm={users}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run / "log.txt").read_text()
    assert "NumClassCheckHook, PreemptionHook, PortableCheckpointHook, RunConfigHook" in log
    assert "visualizer backends: LocalVisBackend, MetricSinkBackend" in log
    assert len(read_history(run / "metrics.jsonl")) > 1
    checkpoint = Path((run / "last_checkpoint").read_text().strip())
    assert "state_dict" in torch.load(checkpoint, weights_only=True)


def test_two_ranks_gathering_into_a_users_folder_leave_it_intact(toy_coco, tmp_path, outside_dir):
    """mmengine gathers the ranks' results through files in collect_dir, then deletes the folder: a user's folder
    named there is refused before the runner is built, and stays as it was."""
    victim = outside_dir / "thesis"
    (victim / "sub").mkdir(parents=True)
    (victim / "thesis.tex").write_text("chapter 1")
    (victim / "sub" / "data.csv").write_text("1,2")
    run = tmp_path / "run"
    dump = f"{{type: DumpResults, out_file_path: {run}/d.pkl, collect_dir: {victim}}}"
    script, experiment = TOY["det"]
    proc = prewarmed.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(REPO / script),
            f"experiment={experiment}", *FAST, f"data.root={toy_coco}", f"output_dir={run}", "schedule.epochs=1",
            f"+mm={{val_evaluator: [{dump}]}}",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=TOY_RUN_S, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode != 0 and "mm.val_evaluator[0].collect_dir: DumpResults would write" in proc.stderr
    assert (victim / "thesis.tex").read_text() == "chapter 1" and (victim / "sub" / "data.csv").read_text() == "1,2"
