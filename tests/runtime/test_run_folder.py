"""A run touches only what it owns: the folders a run may take (new, empty, or marked as a cat run's), those it
refuses outright, the temporaries it deletes, and the names it never writes through (links, FIFOs, folders)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cat.errors import OutputError
from cat.runtime import DistEnv, open_run_folder
from cat.runtime.io import atomic_write_text, open_append, remove_stale_temporaries, temporary_path
from cat.runtime.ownership import RUN_MARKER, is_run_folder, output_dir_problems
from tests import prewarmed
from tests.conftest import REPO, TINY_CLS, refusal_line
from tests.entry_cases import run_entry_cases
from tests.subprocess_output import output_tail


def _tree(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` (links not followed) with its content's hash: what a refused run must leave."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            found[str(path.relative_to(folder))] = f"-> {os.readlink(path)}"
        elif path.is_file():
            found[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[str(path.relative_to(folder))] = "<dir>" if path.is_dir() else "<special>"
    return found


def _checkout_like(folder: Path) -> Path:
    """A folder holding a user's work: a file and a ``.git`` folder."""
    (folder / ".git" / "objects").mkdir(parents=True)
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (folder / "thesis.tex").write_text("\\section{Results}\n")
    return folder


def _legacy_run(folder: Path) -> Path:
    """A run folder as runs made them before markers: config.yaml with a job's keys, a log, a checkpoint."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("name: run\nmode: train\noutput_dir: x\nseed: 0\nresume: true\nmodel: {}\n")
    (folder / "log.txt").write_text("[2026-01-01 00:00:00] train mode\n")
    (folder / "last.pth").write_bytes(b"checkpoint")
    return folder


def test_a_new_or_empty_folder_is_taken_and_marked(tmp_path):
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "new" / "run", tmp_path / "empty"):
        assert output_dir_problems(str(folder)) == []
        open_run_folder(str(folder), DistEnv()).close()
        marker = json.loads((folder / RUN_MARKER).read_text())
        assert marker["cat_run"] == 1 and marker["pid"] == os.getpid() and is_run_folder(str(folder))


def test_a_folder_that_is_not_a_runs_is_refused_and_left_as_it_was(tmp_path):
    work = _checkout_like(tmp_path / "work")
    before = _tree(work)
    [problem] = output_dir_problems(str(work))
    assert problem == (
        f"output_dir={work} holds files that are not a cat run's (2 entries, e.g. .git, thesis.tex); "
        "choose an empty or new folder"
    )
    for start_over in (False, True):
        with pytest.raises(OutputError, match="not a cat run's"):
            open_run_folder(str(work), DistEnv(), start_over=start_over)
    assert _tree(work) == before


def test_a_run_folder_from_before_markers_resumes_and_is_marked(tmp_path):
    run = _legacy_run(tmp_path / "run")
    assert output_dir_problems(str(run)) == [] and is_run_folder(str(run))
    folder = open_run_folder(str(run), DistEnv())
    folder.close()
    assert (run / RUN_MARKER).is_file() and (run / "last.pth").read_bytes() == b"checkpoint"
    assert "a run folder from before run markers" in (run / "log.txt").read_text()
    # A config.yaml alone, or one without a job's keys beside a log: not a run's.
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.yaml").write_text("lr: 0.1\n")
    (other / "log.txt").write_text("mine\n")
    assert not is_run_folder(str(other)) and output_dir_problems(str(other))


@pytest.mark.parametrize(
    "where",
    ["empty", "root", "home", "checkout", "above the checkout", "cwd", "folder of runs", "data root", "inside data"],
)
def test_folders_no_run_may_own_are_refused_outright(tmp_path, monkeypatch, where):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    data = tmp_path / "imagenet"
    (data / "train").mkdir(parents=True)
    runs = tmp_path / "outputs" / "cls"
    for name in ("a", "b"):
        open_run_folder(str(runs / name), DistEnv()).close()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    # A checkout under the temporary folder (a clone in /tmp) has this test's home below its parent too: that is
    # named first.
    above = "your home folder" if home.is_relative_to(REPO.parent) else "the cat checkout"
    output_dir, expected = {
        "empty": ("", "output_dir is empty (an unset shell variable?)"),
        "root": ("/", "output_dir=/ holds your home folder"),
        "home": (str(home), f"output_dir={home} is your home folder"),
        "checkout": (str(REPO), f"output_dir={REPO} is the cat checkout"),
        "above the checkout": (str(REPO.parent), f"output_dir={REPO.parent} holds {above}"),
        "cwd": (".", "output_dir=. is the current directory, not a cat run's folder"),
        "folder of runs": (str(runs), f"output_dir={runs} holds other runs' folders (a, b)"),
        "data root": (str(data), f"output_dir={data} is inside data.root={data}"),
        "inside data": (str(data / "train" / "run"), f"output_dir={data / 'train' / 'run'} is inside data.root"),
    }[where]
    [problem] = output_dir_problems(output_dir, [None, str(data)])
    assert problem.startswith(expected), problem


def test_only_temporaries_cat_named_are_deleted(tmp_path):
    ours = Path(temporary_path(str(tmp_path / "last.pth")))
    ours.write_bytes(b"torn")
    users = [".notes.tmp", ".last.pth.abc123.tmp", ".cat-tmp-xyz-last.pth", "draft.tmp"]
    for name in users:
        (tmp_path / name).write_text("mine")
    (tmp_path / ".cat-tmp-0123456789abcdef-dir").mkdir()  # the shape, but a folder: not ours
    assert remove_stale_temporaries(str(tmp_path)) == [str(ours)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*users, ".cat-tmp-0123456789abcdef-dir"])


def _plant(path: Path, kind: str, outside: Path) -> None:
    if kind == "symlink out":
        path.symlink_to(outside)
    elif kind == "FIFO":
        os.mkfifo(path)
    else:
        path.mkdir()


KINDS = ("symlink out", "FIFO", "folder")


def _append(path: str) -> None:
    open_append(path).close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("name", "write"),
    [
        *((name, _append) for name in ("log.txt", "metrics.jsonl", "config_changes.jsonl", "wandb_run_id.txt")),
        *((name, lambda path: atomic_write_text(path, "new")) for name in ("config.yaml", "metrics.json", "last.pth")),
    ],
)
def test_a_write_never_follows_blocks_on_or_replaces_a_planted_name(tmp_path, kind, name, write):
    """Appended files (opened without following a link, without blocking on a FIFO) and replaced ones (renamed over
    a regular file only): either way one error naming the file, the name and what it points to as they were."""
    outside = tmp_path / "outside.txt"
    outside.write_text("the user's\n")
    _plant(tmp_path / name, kind, outside)
    with pytest.raises(OutputError, match=f"{name} is a (symbolic link|FIFO|folder), not a regular file"):
        write(str(tmp_path / name))
    assert outside.read_text() == "the user's\n" and os.path.lexists(tmp_path / name)


@pytest.mark.parametrize("name", ["profile", "eval", "wandb", "earlier_runs"])
def test_a_file_where_a_run_keeps_a_folder_is_refused_as_the_folder_is_taken(tmp_path, name):
    """``profile`` as a regular file ended a run with NotADirectoryError after its first step, with no checkpoint."""
    run = tmp_path / "run"
    open_run_folder(str(run), DistEnv()).close()
    (run / name).write_text("the user's")
    with pytest.raises(OutputError, match=f"{name} is a file where a run keeps a folder"):
        open_run_folder(str(run), DistEnv())
    assert (run / name).read_text() == "the user's"


# Every name a run writes in its folder, as a run meets it: each planted as a link out of the folder, a FIFO or a
# folder ends the run in one line before anything is written, and what the link points to is untouched.
RUN_NAMES = [
    "log.txt",
    "metrics.jsonl",
    "metrics.json",
    "config_changes.jsonl",
    "config.yaml",
    "overrides.yaml",
    "wandb_run_id.txt",
    ".started_over",
    ".lock",
    "last.pth",
    "best.pth",
    "epoch_0001.pth",  # the snapshot the second epoch writes
    "profile",
    "eval",
    "throughput",
]


def _train(out: Path, *overrides: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return prewarmed.run(
        [sys.executable, str(REPO / "train_cls.py"), *TINY_CLS, "epochs=1", f"output_dir={out}", *overrides],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_a_planted_name_in_a_run_folder_ends_the_run_in_one_line(tmp_path):
    base = tmp_path / "base"
    trained = _train(base)
    assert trained.returncode == 0, output_tail(trained)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "file").write_text("the user's\n")
    cases, folders = {}, {}
    for name in RUN_NAMES:
        for kind in KINDS:
            out = tmp_path / "cases" / f"{name}-{kind}".replace(" ", "_")
            shutil.copytree(base, out, symlinks=True)
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif os.path.lexists(path):
                path.unlink()
            # eval/ and profile/ are folders a run makes: a link to a folder outside is what is planted there
            folder_name = name in ("profile", "eval", "throughput")
            _plant(
                path,
                "symlink out" if folder_name and kind == "folder" else kind,
                outside / ("" if folder_name else "file"),
            )
            overrides = {
                "eval": ["mode=eval", f"checkpoint={out / 'last.pth'}"],
                "throughput": ["mode=throughput"],
            }.get(name, ["profile.steps=[1,1]"])
            cases[f"{name} as {kind}"] = [*TINY_CLS, "epochs=2", f"output_dir={out}", *overrides]
            folders[f"{name} as {kind}"] = (path, _tree(out))
    runs = run_entry_cases("train_cls.py", cases)
    for case, (path, before) in folders.items():
        line = refusal_line(runs[case])
        assert str(path) in line, (case, line)
        assert _tree(path.parent) == before, case
    assert (outside / "file").read_text() == "the user's\n" and sorted(os.listdir(outside)) == ["file"]


@pytest.mark.slow
def test_an_empty_output_dir_moves_nothing(tmp_path):
    """``output_dir=$OUT`` with OUT unset: refused, and every byte of the folder it was run from is where it was."""
    work = _checkout_like(tmp_path / "work")
    before = _tree(work)
    for overrides in (["output_dir=", "resume=false"], ["name=", "resume=false"], ["output_dir=.", "resume=false"]):
        line = refusal_line(_train(work, *overrides, cwd=work))
        assert ("output_dir" in line or "name" in line) and "earlier_runs" not in line, line
        assert _tree(work) == before, overrides


@pytest.mark.parametrize(
    ("record", "now", "relaunch"),
    [
        ({"job": "7"}, {"job": "7", "restarts": 1}, True),  # Slurm requeued the job
        ({"job": "7"}, {"job": "7"}, False),  # the same job's start: a second launch inside it, by hand
        ({"job": "7"}, {"job": "8", "restarts": 1}, False),  # another job
        ({"run": "r"}, {"run": "r", "elastic": 1}, True),  # torchrun restarted its workers
        ({"run": "r"}, {"run": "s", "elastic": 1}, False),  # another torchrun
        ({"job": "7", "run": "r"}, {"job": "7", "run": "r", "elastic": 1}, True),
        ({}, {}, False),  # by hand, twice
    ],
)
def test_a_relaunch_is_the_same_slurm_job_requeued_or_the_same_torchrun_restarted(monkeypatch, record, now, relaunch):
    """cat.runtime.ownership's launch record (what a run that starts over writes, .started_over) and the one test a
    later start passes to go on with that run."""
    from cat.runtime.ownership import launch_record, relaunch_of

    def launch(job=None, restarts=0, run=None, elastic=0) -> dict:
        for name, value in (
            ("SLURM_JOB_ID", job),
            ("SLURM_RESTART_COUNT", str(restarts)),
            ("TORCHELASTIC_RUN_ID", run),
            ("TORCHELASTIC_RESTART_COUNT", str(elastic)),
        ):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        return launch_record()

    assert relaunch_of(launch(**record), launch(**now)) is relaunch


def test_the_started_over_record_is_read_only_when_it_is_cats(tmp_path):
    from cat.runtime.ownership import STARTED_OVER, read_started_over

    assert read_started_over(str(tmp_path)) is None
    good = {"slurm_job_id": "7", "slurm_restarts": 0, "torchelastic_run_id": None, "torchelastic_restarts": 0}
    (tmp_path / STARTED_OVER).write_text(json.dumps(good))
    assert read_started_over(str(tmp_path)) == good
    for bad in ({**good, "slurm_restarts": "0"}, {**good, "slurm_job_id": ""}, ["not", "a", "record"]):
        (tmp_path / STARTED_OVER).write_text(json.dumps(bad))
        with pytest.raises(OutputError, match="is not cat's record of the launch"):
            read_started_over(str(tmp_path))
    (tmp_path / STARTED_OVER).unlink()
    os.mkfifo(tmp_path / STARTED_OVER)  # a FIFO planted at its name: refused, never blocked on
    with pytest.raises(OutputError, match="is not cat's record"):
        read_started_over(str(tmp_path))


def test_writable_is_probed_by_writing(tmp_path):
    from cat.runtime.ownership import check_writable

    assert check_writable(str(tmp_path / "new" / "deeper")) is None  # made later: its nearest folder decides
    (tmp_path / "file").write_text("")
    assert (
        check_writable(str(tmp_path / "file" / "run"))
        == f"output_dir={tmp_path / 'file' / 'run'}: {tmp_path / 'file'} is a file, not a folder"
    )
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    assert "a symbolic link to" in check_writable(str(tmp_path / "dangling"), "hydra.run.dir")


def test_starting_over_moves_only_what_the_run_recorded_making(tmp_path):
    """resume=false sets aside what the folder's runs recorded making (their files, checkpoints, mmengine's config and
    log folders, whatever the name); a user's file or folder in the run folder stays where it is, even one named like
    a checkpoint, and the log names it."""
    folder = open_run_folder(str(tmp_path), DistEnv())
    for name in ("last.pth", "epoch_3.pth", "metrics.jsonl", "mm_config.py", "last_checkpoint", "weights.bin"):
        (tmp_path / name).write_text("x")
    (tmp_path / "20261205_101010").mkdir()
    folder.close()  # the run's end records what it made
    (tmp_path / "imagenet_pretrained.pth").write_text("mine")
    (tmp_path / "data" / "train" / "a").mkdir(parents=True)  # a copy of the dataset a user keeps beside the run
    (tmp_path / "data" / "train" / "a" / "0.png").write_bytes(b"png")
    (tmp_path / "notes.md").write_text("mine")
    open_run_folder(str(tmp_path), DistEnv(), start_over=True).close()
    (kept,) = (tmp_path / "earlier_runs").iterdir()
    assert sorted(p.name for p in kept.iterdir()) == [
        ".cat-made", "20261205_101010", "epoch_3.pth", "last.pth", "last_checkpoint", "log.txt", "metrics.jsonl",
        "mm_config.py", "weights.bin",
    ]  # fmt: skip
    assert (tmp_path / "imagenet_pretrained.pth").read_text() == "mine"
    assert (tmp_path / "data" / "train" / "a" / "0.png").read_bytes() == b"png"
    assert (tmp_path / "notes.md").read_text() == "mine"
    log = (tmp_path / "log.txt").read_text()
    assert "resume=false left in" in log and "data, imagenet_pretrained.pth, notes.md" in log
    # The new run's record holds what it made, not the user's files: a second start over leaves them again.
    assert json.loads((tmp_path / ".cat-made").read_text())["names"] == ["log.txt"]
    open_run_folder(str(tmp_path), DistEnv(), start_over=True).close()
    assert (tmp_path / "imagenet_pretrained.pth").read_text() == "mine"


def test_what_another_process_puts_in_the_folder_while_the_run_holds_it_is_not_the_runs(tmp_path):
    """The record holds what the run's own process wrote (its writers and the libraries it calls), not every name
    that appeared: a user's notes and weights copied in while the run trains stay on a start over, named in the
    log, while the run's own checkpoint (written through a rename, as cat's atomic writes finish) and a folder it
    made move aside."""
    folder = open_run_folder(str(tmp_path), DistEnv())
    (tmp_path / "ckpt.pth.tmp").write_text("x")
    os.replace(tmp_path / "ckpt.pth.tmp", tmp_path / "ckpt.pth")
    (tmp_path / "profile" / "trace").mkdir(parents=True)
    script = "import pathlib, sys; [pathlib.Path(sys.argv[1], n).write_text('mine') for n in sys.argv[2:]]"
    subprocess.run([sys.executable, "-c", script, str(tmp_path), "notes.txt", "imagenet_pretrained.pth"], check=True)
    folder.record_made()
    folder.close()
    assert json.loads((tmp_path / ".cat-made").read_text())["names"] == ["ckpt.pth", "log.txt", "profile"]
    open_run_folder(str(tmp_path), DistEnv(), start_over=True).close()
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "imagenet_pretrained.pth").read_text() == "mine"
    assert not (tmp_path / "ckpt.pth").exists() and not (tmp_path / "profile").exists()
    assert "imagenet_pretrained.pth, notes.txt" in (tmp_path / "log.txt").read_text()


def test_a_run_killed_before_recording_leaves_its_files_in_place_and_named(tmp_path):
    """What a killed run wrote after its last record is not known to be a run's: starting over leaves it in place,
    names it, and never moves a file the folder held when the run took it."""
    folder = open_run_folder(str(tmp_path), DistEnv())
    (tmp_path / "late.pth").write_text("x")
    folder.lock.held = False  # killed: no record at its end, no lock released
    (tmp_path / ".lock").unlink()
    open_run_folder(str(tmp_path), DistEnv(), start_over=True).close()
    assert (tmp_path / "late.pth").is_file()
    assert "what no run recorded making there: late.pth" in (tmp_path / "log.txt").read_text()


def test_a_record_that_is_not_cats_is_refused(tmp_path):
    open_run_folder(str(tmp_path), DistEnv()).close()
    (tmp_path / ".cat-made").write_text('{"cat_made": 1, "names": ["../x"]}')
    for start_over in (True, False):
        with pytest.raises(OutputError, match=r"\.cat-made is not cat's record of what runs made"):
            open_run_folder(str(tmp_path), DistEnv(), start_over=start_over)
    assert not (tmp_path / ".lock").exists()


def test_a_dataset_inside_the_run_folder_is_refused(tmp_path):
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    assert output_dir_problems(str(run), [str(run / "data")]) == [
        f"data.root={run / 'data'} is inside output_dir={run}: a run folder holds what runs write, which resume=false "
        "moves aside; keep the dataset outside it"
    ]


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the marker to another user")
def test_a_run_folder_marked_by_another_user_is_refused_like_a_foreign_folder(tmp_path):
    """A root run never takes a folder whose marker another user's run wrote (nor moves its files)."""
    open_run_folder(str(tmp_path), DistEnv()).close()
    (tmp_path / "last.pth").write_text("theirs")
    os.chown(tmp_path / RUN_MARKER, 4242, 4242)
    (problem,) = output_dir_problems(str(tmp_path))
    assert problem.startswith(f"{tmp_path} is another user's run folder (its marker .cat-run belongs to uid 4242")
    with pytest.raises(OutputError, match="another user's run folder"):
        open_run_folder(str(tmp_path), DistEnv(), start_over=True)
    assert (tmp_path / "last.pth").read_text() == "theirs" and not (tmp_path / "earlier_runs").exists()


def test_an_append_never_writes_through_a_hard_link(tmp_path):
    """A log or metric history with a second name (a hard link to a file outside the run) is refused like a
    symbolic link: appending to it would write into the other file too."""
    outside = tmp_path / "outside.txt"
    outside.write_text("theirs\n")
    run = tmp_path / "run"
    open_run_folder(str(run), DistEnv()).close()
    (run / "metrics.jsonl").unlink(missing_ok=True)
    os.link(outside, run / "metrics.jsonl")
    with pytest.raises(OutputError, match=r"metrics.jsonl has 2 names \(a hard link\)"):
        open_append(str(run / "metrics.jsonl"))
    assert outside.read_text() == "theirs\n"
