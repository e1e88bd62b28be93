"""cat.runtime.resume on its own: whether a run resumes, what a resume may change (FIXED refused, RECIPE told
apart, ``resume`` itself ignored), a shorter run refused in one line, and a relaunched ``resume=false`` run going
on with the run it started."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from cat.errors import ConfigError
from cat.runtime.resume import (
    START_OVER,
    check_resume,
    config_changes,
    describe_changes,
    recipe_changes,
    refuse_shorter_run,
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
    changed = check_resume("last.pth", saved, recipe)
    assert set(changed) == {"lr", "epochs"} and changed["lr"][1] == 0.01  # resume itself is no change
    assert recipe_changes(changed, recipe) == {"lr": changed["lr"]}  # epochs: free; lr: the recipe's
    assert describe_changes({"lr": [0.1, 0.01]}) == "lr: 0.1 -> 0.01"
    fixed = _with(cfg, batch_size=16, seed=3)
    with pytest.raises(ConfigError) as refused:
        check_resume("last.pth", saved, fixed, ["world size 2 -> 4 (mid-epoch)"])
    lines = str(refused.value).splitlines()
    assert any("cannot resume last.pth with a different batch_size:" in line for line in lines)
    assert any("with a different seed:" in line for line in lines)
    assert any("with a different world size 2 -> 4 (mid-epoch)" in line for line in lines)
    assert START_OVER in lines[-1]


def test_config_changes_are_per_dotted_key():
    saved = {"a": {"b": 1, "c": 2}, "resume": True, "gone": 1}
    current = {"a": {"b": 1, "c": 3}, "resume": False, "new": {"x": None}}
    assert config_changes(saved, current) == {"a.c": [2, 3], "gone": [1, None]}


def test_a_shorter_run_is_refused_saying_how_far_the_checkpoint_got():
    with pytest.raises(ConfigError, match=r": epochs=3: last\.pth has trained 5 epochs; a shorter run needs"):
        refuse_shorter_run("epochs=3", "last.pth", 5, "epochs")
    with pytest.raises(ConfigError, match=r"schedule\.iters=10: iter_20\.pth has begun iteration 21;"):
        refuse_shorter_run("schedule.iters=10", "iter_20.pth", 20, "iterations", begun=True)


def test_a_file_inside_output_dir_is_no_start_for_a_run_that_starts_over(tmp_path):
    resuming = _cfg(tmp_path)
    starting_over = _with(resuming, resume=False)
    inside = tmp_path / "run" / "best.pth"
    inside.parent.mkdir()
    inside.write_bytes(b"")
    assert "inside output_dir" in starting_file_problem(starting_over, "checkpoint", str(inside))
    assert starting_file_problem(resuming, "checkpoint", str(inside)) is None


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
