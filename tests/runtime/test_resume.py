"""cat.runtime.resume: whether a run resumes, what a resume may change (FIXED refused, ``resume`` itself ignored),
the run length (GROW) and the recipe (RECIPE) ruled the same through both trainers, and a relaunched
``resume=false`` run going on with the run it started."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest

from cat.errors import ConfigError
from cat.runtime import DistEnv, open_run_folder
from cat.runtime.resume import (
    START_OVER,
    check_resume,
    config_changes,
    describe_changes,
    resume_relaunched_start_over,
    resumes,
    starting_file_problem,
)
from cat.runtime.schema import config_record
from tests.conftest import checked_config


def _cfg(tmp_path, *overrides: str):
    return checked_config("cls", f"output_dir={tmp_path / 'run'}", *overrides)


def _with(cfg, **changes):
    """``cfg`` with top-level keys changed, as a resume would see them (no second composition)."""
    return dataclasses.replace(cfg, **changes)


def test_a_run_resumes_only_when_training_with_resume_and_a_checkpoint(tmp_path):
    cfg = _cfg(tmp_path)
    starting_over, evaluating = _with(cfg, resume=False), _with(cfg, mode="eval")
    assert not resumes(cfg, "last.pth")  # no checkpoint yet
    os.makedirs(cfg.output_dir)
    (tmp_path / "run" / "last.pth").write_bytes(b"")
    assert resumes(cfg, "last.pth")
    assert not resumes(starting_over, "last.pth") and not resumes(evaluating, "last.pth")


def test_what_a_resume_may_change(tmp_path):
    cfg = _cfg(tmp_path)
    saved = config_record(cfg)
    recipe = _with(cfg, lr=0.01, epochs=30, resume=False)
    changed = check_resume("last.pth", saved, recipe, None)
    assert set(changed) == {"lr", "epochs"} and changed["lr"][1] == 0.01  # resume itself is no change
    assert describe_changes({"lr": [0.1, 0.01]}) == "lr: 0.1 -> 0.01"
    fixed = _with(cfg, batch_size=16, seed=3)
    with pytest.raises(ConfigError) as refused:
        check_resume("last.pth", saved, fixed, None, ["world size 2 -> 4 (mid-epoch)"])
    lines = str(refused.value).splitlines()
    assert any("cannot resume last.pth with a different batch_size:" in line for line in lines)
    assert any("with a different seed:" in line for line in lines)
    assert any("with a different world size 2 -> 4 (mid-epoch)" in line for line in lines)
    assert START_OVER in lines[-1]


def test_config_changes_are_per_dotted_key():
    saved = {"a": {"b": 1, "c": 2}, "resume": True, "gone": 1}
    current = {"a": {"b": 1, "c": 3}, "resume": False, "new": {"x": None}}
    assert config_changes(saved, current) == {"a.c": [2, 3], "gone": [1, None]}


# How far the checkpoint got (``done`` units of the run length, the next ``begun``), the length asked for, whether the
# recipe changed (amp.enabled: RECIPE in every task), and the refusal, or None where the resume goes on.
LENGTH_CASES = [
    (5, False, 3, False, "{key}=3: {ckpt} has trained 5 {unit}; a shorter run needs another output_dir"),
    (5, True, 5, False, "{key}=5: {ckpt} has begun {one} 6; a shorter run needs another output_dir"),
    (5, True, 6, False, None),
    (5, False, 5, False, None),
    (5, False, 5, True, "{ckpt} has finished its 5 {unit}, so amp.enabled: {was} -> {now} would train nothing"),
    (5, True, 5, True, "{key}=5: {ckpt} has begun {one} 6; a shorter run needs another output_dir"),
    (5, False, 8, True, None),
]


def _with_length_and_amp(cfg, key: str, length: int, flip_amp: bool):
    """``cfg`` with its run length (``epochs``, ``schedule.epochs`` or ``schedule.iters``) and maybe amp changed."""
    *section, name = key.split(".")
    if section:
        cfg = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, **{name: length}))
    else:
        cfg = dataclasses.replace(cfg, **{name: length})
    # A definite change whatever the saved value ("auto" included): to true unless it was true.
    return (
        dataclasses.replace(cfg, amp=dataclasses.replace(cfg.amp, enabled=cfg.amp.enabled is not True))
        if flip_amp
        else cfg
    )


def _resume_classification(tmp_path, saved_cfg, cfg, done: int, begun: bool) -> None:
    """classification's resume (cat.classification.trainer.resume) of a last.pth that trained ``done`` epochs."""
    from cat.classification.checkpoints import CheckpointManager
    from cat.classification.trainer import resume
    from cat.runtime import DistEnv, RunFolder
    from tests.classification.test_loops import _tiny_circulant_state

    state = _tiny_circulant_state()
    manager = CheckpointManager(str(tmp_path))
    # A checkpoint's epoch is the last one finished (0-based); mid-epoch, the next one's steps are under way.
    entries = {**state.state_dict(), "epoch": done - 1, "step_in_epoch": 2 if begun else 0}
    manager.save({**entries, "config": config_record(saved_cfg)}, epoch_end=False)
    folder = RunFolder(str(tmp_path), logging.getLogger("test_resume"), is_main=True)
    resume(cfg, DistEnv(), folder, manager, state, steps_per_epoch=4)


def _resume_mm(tmp_path, saved_cfg, cfg, done: int, begun: bool) -> None:
    """detection's or segmentation's resume (cat.mm.runner.check_resume_config) of a checkpoint that trained
    ``done`` epochs or iterations, as mmengine and cat's preemption name and record it."""
    import torch

    from cat.mm.runner import check_resume_config
    from cat.mm.safe_load import install_safe_checkpoint_io
    from cat.runtime import RunFolder

    install_safe_checkpoint_io()
    by_epoch = hasattr(cfg.schedule, "epochs")
    meta = {"epoch": done, "iter": 10 * done + 3 * begun} if by_epoch else {"epoch": 0, "iter": done}
    name = f"iter_{meta['iter']}.pth" if begun or not by_epoch else f"epoch_{done}.pth"
    torch.save({"meta": meta, "state_dict": {}, "config": config_record(saved_cfg)}, tmp_path / name)
    (tmp_path / "last_checkpoint").write_text(str(tmp_path / name))
    check_resume_config(cfg, RunFolder(str(tmp_path), logging.getLogger("test_resume"), is_main=True))


@pytest.mark.parametrize("task", ["cls", "det", "seg"])
@pytest.mark.parametrize(("done", "begun", "length", "recipe", "refusal"), LENGTH_CASES)
def test_run_length_and_recipe_one_rule_in_both_trainers(task, done, begun, length, recipe, refusal, tmp_path):
    """The run length may grow but never fall below what the checkpoint trained or began (the record would claim the
    shorter run), and a recipe change needs a step left to train: the keys declare it (GROW, RECIPE), one rule
    applies it (cat.runtime.resume.check_resume), and each trainer only says how far its checkpoint got."""
    from cat.runtime.schema import run_length_key
    from tests.conftest import as_typed, compose_config

    if task == "seg" and begun:
        pytest.skip("an iteration-based run has no part-done unit")
    if task != "cls":
        pytest.importorskip("mmseg", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")
    overrides = [f"output_dir={tmp_path}"] if task == "cls" else ["data.root=/data/a"]
    saved_cfg = as_typed(compose_config(task, *overrides), task)
    key = run_length_key(type(saved_cfg))
    saved_cfg = _with_length_and_amp(saved_cfg, key, 30, False)
    cfg = _with_length_and_amp(saved_cfg, key, length, recipe)
    resume = _resume_classification if task == "cls" else _resume_mm
    if refusal is None:
        resume(tmp_path, saved_cfg, cfg, done, begun)
        return
    with pytest.raises(ConfigError) as refused:
        resume(tmp_path, saved_cfg, cfg, done, begun)
    unit = "epochs" if key.endswith("epochs") else "iterations"
    checkpoint = next(str(p) for p in tmp_path.iterdir() if p.suffix == ".pth")
    expected = refusal.format(
        key=key, ckpt=checkpoint, unit=unit, one=unit[:-1], was=repr(saved_cfg.amp.enabled), now=repr(cfg.amp.enabled)
    )
    assert [problem for problem in refused.value.problems if problem.startswith(expected)], refused.value.problems


def test_a_file_the_run_made_is_no_start_for_a_run_that_starts_over(tmp_path):
    """resume=false moves what the folder's runs made before the run reads it: such a file cannot start it. A user's
    own file there stays in place, and can."""
    resuming = _cfg(tmp_path)
    starting_over = _with(resuming, resume=False)
    folder = open_run_folder(resuming.output_dir, DistEnv())
    (tmp_path / "run" / "best.pth").write_bytes(b"")
    folder.close()
    (tmp_path / "run" / "imagenet_pretrained.pth").write_bytes(b"")
    problem = starting_file_problem(starting_over, "checkpoint", str(tmp_path / "run" / "best.pth"))
    assert "made by the run in output_dir" in problem
    assert starting_file_problem(resuming, "checkpoint", str(tmp_path / "run" / "best.pth")) is None
    assert starting_file_problem(starting_over, "checkpoint", str(tmp_path / "run" / "imagenet_pretrained.pth")) is None


@pytest.mark.parametrize(
    "launch, goes_on",
    [
        ({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}, True),  # the same job, requeued
        ({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"}, False),  # the same start of it: launched again by hand
        ({"SLURM_JOB_ID": "8", "SLURM_RESTART_COUNT": "1"}, False),  # another job
    ],
)
def test_a_relaunched_start_over_goes_on_with_its_run(tmp_path, monkeypatch, launch, goes_on):
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    cfg = _cfg(tmp_path, "resume=false")
    os.makedirs(cfg.output_dir)
    record = {"slurm_job_id": "7", "slurm_restarts": 0, "torchelastic_run_id": None, "torchelastic_restarts": 0}
    (tmp_path / "run" / ".started_over").write_text(json.dumps(record))
    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    settled, line = resume_relaunched_start_over(cfg)
    assert (line is not None) == goes_on and settled.resume == goes_on and not cfg.resume
    if goes_on:
        assert "Slurm job 7, now in its restart 1 (requeued)" in line
