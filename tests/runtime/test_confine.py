"""A run's writes confined by the kernel (Landlock): every way to change the file tree outside the allowed folders
fails where it is tried, inside them works, children inherit it, and a classification run is confined by default
and says so. Each case runs in a process of its own: a confinement cannot be lifted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from cat.runtime.confine import abi_version, writable_folders
from tests import prewarmed
from tests.conftest import REPO, TOY_RUN_S

needs_landlock = pytest.mark.skipif(abi_version() < 1, reason="this kernel has no Landlock")

# In the confined child: each operation outside (must fail with EACCES, the file's bytes unchanged) and inside.
_PROBE = textwrap.dedent(
    """
    import errno, json, os, subprocess, sys
    from cat.runtime.confine import confine, refused_write
    inside, outside = sys.argv[1], sys.argv[2]
    confine([inside])
    planted = os.path.join(outside, "planted.txt")
    ops = {
        "create": lambda d: open(os.path.join(d, "new.txt"), "x").close(),
        "overwrite": lambda d: open(os.path.join(d, "planted.txt"), "w").close(),
        "append": lambda d: open(os.path.join(d, "planted.txt"), "a").close(),
        "truncate": lambda d: os.truncate(os.path.join(d, "planted.txt"), 0),
        "delete": lambda d: os.unlink(os.path.join(d, "planted.txt")),
        "rename": lambda d: os.rename(os.path.join(d, "planted.txt"), os.path.join(d, "moved.txt")),
        "mkdir": lambda d: os.mkdir(os.path.join(d, "sub")),
        "rmdir": lambda d: os.rmdir(os.path.join(d, "victim")),
        "symlink": lambda d: os.symlink("/etc/passwd", os.path.join(d, "link")),
        "fifo": lambda d: os.mkfifo(os.path.join(d, "fifo")),
        "child": lambda d: subprocess.run(["sh", "-c", f"echo x > {d}/child.txt"], check=True),
    }
    result = {}
    for name, op in ops.items():
        try:
            op(outside)
            result[name] = "done"
        except PermissionError as error:
            result[name] = "refused" if error.errno == errno.EACCES else repr(error)
        except subprocess.CalledProcessError:
            result[name] = "refused"
    try:
        open(os.path.join(outside, "x.txt"), "w")
    except PermissionError as error:
        result["line"] = refused_write(error)
    os.makedirs(os.path.join(inside, "victim"))
    open(os.path.join(inside, "planted.txt"), "w").write("run's")
    for name in ("create", "append", "truncate", "rename", "mkdir", "rmdir", "symlink", "fifo", "child"):
        ops[name](inside)
    print(json.dumps(result))
    """
)


@needs_landlock
def test_the_kernel_refuses_every_kind_of_write_outside_and_takes_them_inside(tmp_path):
    inside, outside = tmp_path / "run", tmp_path.parent / f"{tmp_path.name}_outside"
    inside.mkdir()
    outside.mkdir()
    (outside / "victim").mkdir()
    (outside / "planted.txt").write_text("theirs")
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(inside), str(outside)], capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    line = result.pop("line")
    assert set(result.values()) == {"refused"}, result
    assert (outside / "planted.txt").read_text() == "theirs"
    assert sorted(p.name for p in outside.iterdir()) == ["planted.txt", "victim"]
    assert line.startswith(f"the run may not write {outside / 'x.txt'}: ") and f"run.may_write=[{outside}]" in line
    assert (inside / "child.txt").read_text() == "x\n" and (inside / "moved.txt").exists()


def test_the_allowed_folders_are_named_in_one_place(tmp_path, monkeypatch):
    """The run folder, the temporary folder, /dev, the caches (moved ones included) and the user's own."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folders = writable_folders(str(tmp_path / "run"), [str(tmp_path / "shared")], gpu=True)
    for expected in ("run", "cache", "inductor", "shared"):
        assert str(tmp_path / expected) in folders
    assert "/dev" in folders and os.path.realpath("/tmp") in folders
    assert os.path.expanduser("~/.triton") in folders and os.path.expanduser("~/.nv") in folders
    assert os.path.expanduser("~/.nv") not in writable_folders(str(tmp_path / "run"), gpu=False)


def _quick(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    return prewarmed.run(
        [sys.executable, str(REPO / "train_cls.py"), f"output_dir={tmp_path / 'run'}", "epochs=1", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TOY_RUN_S,
    )


@pytest.mark.slow
@needs_landlock
def test_a_training_run_is_confined_by_default_and_run_confine_false_says_it_is_not(tmp_path):
    shared = tmp_path / "shared"
    proc = _quick(tmp_path, "logger.wandb.mode=disabled", f"run.may_write=[{shared}]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "run" / "log.txt").read_text()
    assert f"writes confined by the kernel (Landlock ABI {abi_version()}) to {tmp_path / 'run'}, " in log
    assert str(shared) in log.split("writes confined by the kernel", 1)[1].splitlines()[0]
    proc = _quick(tmp_path, "logger.wandb.mode=disabled", "run.confine=false", "resume=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "run.confine=false: writes are checked by cat's own checks only" in log
