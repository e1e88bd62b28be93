"""Segmentation on the OpenMMLab stack: toy ADE20K training, Runner resume, mIoU, presets."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from cat.runtime.dist import DistEnv
from cat.runtime.metric_sinks import read_history
from cat.runtime.resume import START_OVER
from tests import prewarmed
from tests.conftest import REPO, TOY_RUN_S, compose_config, mm_builder
from tests.entry_cases import run_entry_cases
from tests.mm.conftest import run_entry, stop_like_slurm

pytestmark = pytest.mark.slow  # end-to-end runs: `pytest -m "not slow"` leaves them out

pytest.importorskip("mmseg", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")

SEG_EXPERIMENTS = sorted(p.stem for p in (REPO / "configs" / "seg" / "experiment").glob("*.yaml"))
FAST = ["logger.wandb.mode=disabled", "log_interval=1", "batch_size=2", "save.interval=3"]


FIRST_WINDOW = ["schedule.iters=3", "schedule.val_interval=3"]


@pytest.fixture(scope="module")
def fpn_run(toy_ade, tmp_path_factory) -> Path:
    """toy_fpn_ca_pvt's first 3 iterations (validated and saved at 3), shared by the tests below."""
    out = tmp_path_factory.mktemp("fpn_run")
    run_entry(
        "train_seg.py", "experiment=toy_fpn_ca_pvt", f"data.root={toy_ade}", f"output_dir={out}", *FIRST_WINDOW, *FAST
    )
    return out


@pytest.mark.parametrize("experiment", ["toy_fpn_ca_pvt", "toy_upernet_ca_swin"])
def test_toy_train_checkpoint_resume_evaluate(experiment, toy_ade, tmp_path, fpn_run):
    out = tmp_path / experiment
    if experiment == "toy_fpn_ca_pvt":  # the shared run's folder, as if it had trained here
        shutil.copytree(fpn_run, out)
        (out / "last_checkpoint").write_text(str(out / "iter_3.pth"))
    else:
        run_entry(
            "train_seg.py",
            f"experiment={experiment}",
            f"data.root={toy_ade}",
            f"output_dir={out}",
            *FIRST_WINDOW,
            *FAST,
        )
    assert (out / "iter_3.pth").is_file()
    proc = run_entry(
        "train_seg.py",
        f"experiment={experiment}",
        f"data.root={toy_ade}",
        f"output_dir={out}",
        "schedule.iters=6",
        "schedule.val_interval=3",
        *FAST,
    )
    assert "Auto resumed from the latest checkpoint" in proc.stdout + proc.stderr
    assert (out / "iter_6.pth").is_file()
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) >= {"mIoU", "mAcc", "aAcc"} and 0 <= metrics["mIoU"] <= 100
    history = read_history(out / "metrics.jsonl")  # through cat's sink: iterations 1-6, val at 3 and 6
    assert sorted({e["step"] for e in history if "loss" in e}) == [1, 2, 3, 4, 5, 6]
    assert [e["step"] for e in history if "mIoU" in e] == [3, 6]
    assert history[-1]["test/mIoU"] == pytest.approx(metrics["mIoU"])
    # The test took the last validation's metrics (the eval below checks them against a real test pass).
    assert "its metrics are the test's (no second pass)" in (out / "log.txt").read_text()
    run_entry(
        "train_seg.py",
        f"experiment={experiment}",
        f"data.root={toy_ade}",
        f"output_dir={out}",
        "mode=eval",
        f"checkpoint={out / 'iter_6.pth'}",
        *FAST,
    )
    assert json.loads((out / "eval" / "metrics.json").read_text())["mIoU"] == pytest.approx(metrics["mIoU"])
    (evaluated,) = read_history(out / "eval" / "metrics.jsonl")  # an eval run's history: its one result
    assert evaluated["test/mIoU"] == pytest.approx(metrics["mIoU"])
    assert json.loads((out / "metrics.json").read_text()) == metrics  # the training record is untouched


def test_a_requeued_start_over_goes_on_with_its_run(toy_ade, tmp_path, fpn_run):
    """resume=false in a requeued Slurm job: the folder was started over by this job's first start, so its restart
    resumes mmengine's checkpoint rather than starting the folder over again."""
    out = tmp_path / "run"
    shutil.copytree(fpn_run, out)
    (out / "last_checkpoint").write_text(str(out / "iter_3.pth"))
    launch = {"slurm_job_id": "77", "slurm_restarts": 0, "torchelastic_run_id": None, "torchelastic_restarts": 0}
    (out / ".started_over").write_text(json.dumps(launch))
    args = ["experiment=toy_fpn_ca_pvt", f"data.root={toy_ade}", f"output_dir={out}", "schedule.iters=6", *FAST[1:]]
    env = {**os.environ, "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1", "WANDB_MODE": "disabled"}
    proc = prewarmed.run(
        [sys.executable, str(REPO / "train_seg.py"), *args, "logger.wandb.mode=disabled", "resume=false"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TOY_RUN_S,
    )
    log = (out / "log.txt").read_text()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "started over by Slurm job 77, now in its restart 1 (requeued); it goes on with that run" in log
    assert f"Auto resumed from the latest checkpoint {out / 'iter_3.pth'}" in log and "resume: False" not in log
    assert (out / "iter_6.pth").is_file() and not (out / "earlier_runs").exists()
    # mmengine's checkpoints and folders are in the run's record of what it made: a start over moves them.
    made = json.loads((out / ".cat-made").read_text())["names"]
    assert {"iter_6.pth", "mm_config.py", "last_checkpoint", "log.txt"} <= set(made), made


def test_checkpoint_starts_a_run_and_its_resume_needs_no_starting_weights(toy_ade, tmp_path, fpn_run):
    """checkpoint= in training is the weights a run starts from (at iteration 1, not where its source
    stopped); the rerun goes on from its own folder, after that file and the backbone's are gone."""
    import cat

    start, backbone = tmp_path / "start.pth", tmp_path / "backbone.pth"
    shutil.copy(fpn_run / "iter_3.pth", start)
    torch.save(cat.create_model("ca_pvt_tiny").state_dict(), backbone)
    out = tmp_path / "run"
    args = ["experiment=toy_fpn_ca_pvt", f"data.root={toy_ade}", f"output_dir={out}", *FAST]
    # The backbone's file where the whole segmentor's weights go: refused before training (mmengine would load
    # none of it, warn, and train from the initialisation), with where it belongs. And another size's backbone
    # (CA-PVT-S's for CA-PVT-T: its first blocks of each stage would load, the rest be ignored with a warning).
    other = tmp_path / "ca_pvt_small.pth"
    torch.save(cat.create_model("ca_pvt_small").state_dict(), other)
    mistaken = run_entry_cases(
        "train_seg.py",
        {
            "mistaken": [*args, f"checkpoint={backbone}", "schedule.iters=2"],
            "other size": [*args, f"model.pretrained={other}", "schedule.iters=2"],
        },
    )
    assert mistaken["mistaken"].returncode == 2 and not list(out.glob("iter_*.pth"))
    assert "it holds a classification model's weights: a backbone takes those from model.pretrained=" in (
        mistaken["mistaken"].stderr
    )
    assert mistaken["other size"].returncode == 2 and not list(out.glob("iter_*.pth"))
    assert f"error: checkpoint {other} does not match the model (a ca_pvt_tiny backbone takes every one of its" in (
        mistaken["other size"].stderr
    )
    assert "unexpected in checkpoint (" in mistaken["other size"].stderr
    args += [f"checkpoint={start}", f"model.pretrained={backbone}", "schedule.val_interval=2"]
    first = run_entry("train_seg.py", *args, "schedule.iters=2")
    log = first.stdout + first.stderr
    assert f"Load checkpoint from {start}" in log and "resumed" not in log
    assert re.findall(r"Iter\(train\) +\[ *(\d+)/2\]", log) == ["1", "2"]
    start.unlink(), backbone.unlink()
    second = run_entry("train_seg.py", *args, "schedule.iters=4")
    log = second.stdout + second.stderr
    assert f"Auto resumed from the latest checkpoint {out / 'iter_2.pth'}" in log
    assert re.findall(r"Iter\(train\) +\[ *(\d+)/4\]", log) == ["3", "4"]
    # Fewer iterations than it trained: refused (mmengine's loop would end at once, and the record would claim the
    # shorter run), the record as it was.
    record = {name: (out / name).read_text() for name in ("config.yaml", "metrics.json")}
    shorter = run_entry_cases("train_seg.py", {"shorter": [*args, "schedule.iters=3"]})["shorter"]
    assert shorter.returncode == 2 and shorter.stderr.strip().splitlines()[-1] == (
        f"error: invalid config: schedule.iters=3: {out / 'iter_4.pth'} has trained 4 iterations; a shorter run needs "
        f"another output_dir (or {START_OVER})"
    )
    assert {name: (out / name).read_text() for name in record} == record


def test_sigterm_saves_the_iteration_and_the_rerun_skips_what_it_trained(toy_ade, tmp_path):
    """SIGTERM to the trainer and its DataLoader workers, as Slurm signals a job step: mmengine's iteration
    loop starts its workers as it is built, and they must still serve the last iteration; the rerun then
    starts its loader after the batches already trained instead of loading and dropping them."""
    out = tmp_path / "run"
    args = [f"data.root={toy_ade}", f"output_dir={out}", "experiment=toy_fpn_ca_pvt", "schedule.iters=30"]
    args += ["schedule.val_interval=30", *FAST, "save.interval=100", "workers=2"]
    status, stderr = stop_like_slurm("train_seg.py", args, out / "log.txt", r"Iter\(train\) +\[ *4/30\]")
    assert status == 0, stderr[-3000:]
    stopped = json.loads((out / "metrics.json").read_text())
    assert stopped["preempted"] is True and (out / f"iter_{stopped['iteration']}.pth").is_file()
    proc = run_entry("train_seg.py", *args)
    log = proc.stdout + proc.stderr
    done = stopped["iteration"]
    assert f"resuming at iteration {done + 1}: skipping the {done} batches it trained" in log
    assert "Advance dataloader" not in log  # mmengine's warning: it advances through no batch here
    trained = re.findall(r"Iter\(train\) +\[ *(\d+)/30\]", log)
    assert trained[0] == str(done + 1) and trained[-1] == "30" and len(trained) == 30 - done
    assert json.loads((out / "metrics.json").read_text())["mIoU"] is not None


def test_eval_with_multiscale_flip(toy_ade, tmp_path, fpn_run):
    run_entry(
        "train_seg.py",
        f"data.root={toy_ade}",
        f"output_dir={tmp_path / 'tta'}",
        "mode=eval",
        "tta=true",
        f"checkpoint={fpn_run / 'iter_3.pth'}",
        *FAST,
    )
    assert json.loads((tmp_path / "tta" / "eval" / "metrics.json").read_text())["mIoU"] is not None


def test_two_process_gloo(toy_ade, tmp_path):
    run_entry(
        "train_seg.py",
        f"data.root={toy_ade}",
        f"output_dir={tmp_path}",
        "schedule.iters=2",
        "schedule.val_interval=2",
        *FAST,
        nproc=2,
    )
    assert json.loads((tmp_path / "metrics.json").read_text())["mIoU"] is not None


def _build(experiment: str, toy_ade, tmp_path):
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules

    from cat.mm.backbone import register_backbones

    register_all_modules()
    register_backbones()
    cfg = compose_config(
        "seg",
        f"experiment={experiment}",
        f"data.root={toy_ade}",
        f"output_dir={tmp_path}",
        "logger.wandb.mode=disabled",
    )
    return cfg, mm_builder("seg")(cfg, DistEnv(), str(tmp_path)), MODELS


@pytest.mark.parametrize("experiment", SEG_EXPERIMENTS)
def test_every_preset_builds_its_segmentor(experiment, toy_ade, tmp_path):
    cfg, mm, models = _build(experiment, toy_ade, tmp_path)
    with torch.device("meta"):
        segmentor = models.build(mm.model)
    assert sum(p.numel() for p in segmentor.backbone.parameters()) > 5e6
    if not experiment.startswith("toy"):
        assert mm.model.decode_head.num_classes == 150
        assert mm.train_cfg.max_iters == (160000 if "upernet" in experiment else 40000)


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["fpn_ca_pvt_t_40k", "upernet_ca_swin_t_160k"])
def test_full_segmentor_forward_512(experiment, toy_ade, tmp_path):
    _, mm, models = _build(experiment, toy_ade, tmp_path)
    segmentor = models.build(mm.model).eval()
    with torch.no_grad():
        logits = segmentor(torch.randn(1, 3, 512, 512), mode="tensor")
    assert logits.shape == (1, 150, 128, 128)
