"""scripts/setup_env.sh runs and installs only what it verified: a cached uv or mmcv wheel is used only where it is
the caller's, writable by no one else, and matches the hash recorded when the script made it. Each case is a real
run of the script, in a copy of the checkout (its own .venv, so the suite's is never touched) with a cache of its own.
The copy's .venv is made once for the file and each case runs the script again over it, as a user re-runs it: the
verification of the cache comes before any install, and a re-run installs only what is missing."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

pytestmark = pytest.mark.slow

PLANTED = "#!/bin/sh\ntouch '{marker}'\nexit 1\n"  # what a planted uv does: leave a mark that it ran


def _checkout(root: Path) -> Path:
    """A copy of the checkout's tracked files (as they are on disk now), without its .venv."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    return root


def _setup(checkout: Path, xdg: Path, *flags: str, **env: str) -> subprocess.CompletedProcess[str]:
    uv_cache = os.environ.get("UV_CACHE_DIR") or str(Path.home() / ".cache" / "uv")
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "uv").exists())
    return subprocess.run(
        ["bash", "scripts/setup_env.sh", *flags],
        cwd=checkout,
        # The copy's venv is thrown away: its bytecode (what a fresh venv spends most of its time on) is not
        # what these cases check, and CI's own setup compiles it.
        env={
            **os.environ,
            "XDG_CACHE_HOME": str(xdg),
            "UV_CACHE_DIR": uv_cache,
            "PATH": path,
            "CAT_COMPILE_BYTECODE": "0",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=900,
    )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _plant(path: Path, marker: Path, record: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(PLANTED.format(marker=marker))
    path.chmod(0o755)
    if record:  # a record that matches: the hash alone does not make a file trusted
        (path.parent / f"{path.name}.sha256").write_text(_sha256(path) + "\n")


def _fake_mmcv(folder: Path) -> Path:
    """A wheel at mmcv 2.1.0's cached name (no compiled ops, nothing imported by the install): what an install of it
    leaves is recognisable by its text."""
    wheel = folder / "mmcv-2.1.0-py3-none-any.whl"
    info = "mmcv-2.1.0.dist-info"
    files = {
        "mmcv/__init__.py": "__version__ = '2.1.0'\n",
        "mmcv/ops/__init__.py": "MADE_BY = 'the cache'\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: mmcv\nVersion: 2.1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n")
    return wheel


def _installed_mmcv(checkout: Path) -> list[Path]:
    return list((checkout / ".venv" / "lib").glob("python*/site-packages/mmcv/ops/__init__.py"))


def _uninstall_mmcv(checkout: Path) -> None:
    python = checkout / ".venv" / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "mmcv"], check=True, capture_output=True)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of the checkout with its .venv made by a first run of the script (its own cache)."""
    root = tmp_path_factory.mktemp("setup_env")
    made = _checkout(root / "checkout")
    # What --mm installs after mmcv is not what these cases check (the cached uv and mmcv wheel are; CI's own setup
    # installs the whole set): one small pinned package of it stands in, so a --mm run still installs a real
    # requirements file without unpacking and compiling mmdet and mmsegmentation again.
    kept = [pin for pin in (made / "requirements-mm.txt").read_text().splitlines() if pin.startswith("ftfy==")]
    assert kept, "requirements-mm.txt no longer pins ftfy: name another small package of it here"
    (made / "requirements-mm.txt").write_text(kept[0] + "\n")
    first = _setup(made, root / "xdg")
    assert first.returncode == 0, first.stderr[-3000:]
    return made


def test_setup_uses_only_the_cached_files_it_verified(checkout, tmp_path):
    xdg, marker = tmp_path / "xdg", tmp_path / "planted_uv_ran"
    cache = xdg / "cat"
    torch_tag = torch.__version__.replace("+", "_")  # the suite's venv's torch, which the copy's venv installs too
    wheels = cache / "wheels" / f"torch-{torch_tag}"
    wheels.mkdir(parents=True)
    wheel = _fake_mmcv(wheels)
    (wheels / f"{wheel.name}.sha256").write_text(_sha256(wheel) + "\n")  # as the script records a wheel it built

    # 1. A private cache: uv is installed into it with its hash recorded, and the recorded wheel is used.
    first = _setup(checkout, xdg, "--mm")
    assert first.returncode == 0, first.stderr[-3000:]
    uv = cache / "uv" / "bin" / "uv"
    assert (uv.parent / "uv.sha256").read_text().strip() == _sha256(uv)
    (installed,) = _installed_mmcv(checkout)
    assert "MADE_BY = 'the cache'" in installed.read_text()

    # 2. The cached uv replaced (same owner, same mode): its hash no longer matches, so it is not run but installed
    # again, and recorded again.
    _plant(uv, marker, record=False)
    second = _setup(checkout, xdg)
    assert second.returncode == 0, second.stderr[-3000:]
    assert not marker.exists(), "the planted uv ran"
    assert f"ignoring the cached {cache / 'uv'}" in second.stderr
    assert (uv.parent / "uv.sha256").read_text().strip() == _sha256(uv) and "touch" not in uv.read_bytes()[:200].decode(
        errors="replace"
    )

    # 3. The wheel made writable by the group: ignored and built again (here the build finds no source, so the run
    # fails), and never installed.
    _uninstall_mmcv(checkout)  # else the script finds mmcv.ops importable and looks at no wheel
    wheel.chmod(0o664)
    third = _setup(checkout, xdg, "--mm", PIP_NO_INDEX="1")
    assert third.returncode != 0
    assert f"ignoring the cached {wheel}" in third.stderr and "building mmcv 2.1.0" in third.stdout
    assert not _installed_mmcv(checkout)


def test_setup_never_runs_a_uv_planted_in_a_cache_others_can_write(checkout, tmp_path):
    """A shared cache anyone can write (the issue's ~/.cache on a shared machine): even a uv with a matching record
    there is not run, and nothing is written into that cache; the run uses a temporary one."""
    xdg, marker = tmp_path / "xdg", tmp_path / "planted_uv_ran"
    _plant(xdg / "cat" / "uv" / "bin" / "uv", marker, record=True)
    for folder in (xdg / "cat", xdg / "cat" / "uv", xdg / "cat" / "uv" / "bin"):
        folder.chmod(0o777)
    before = sorted(str(p.relative_to(xdg)) for p in xdg.rglob("*"))
    run = _setup(checkout, xdg)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not marker.exists(), "the planted uv ran"
    assert f"{xdg / 'cat'} is not private to you" in run.stderr
    assert sorted(str(p.relative_to(xdg)) for p in xdg.rglob("*")) == before


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the cached uv to another user")
def test_setup_never_runs_a_uv_another_user_owns(checkout, tmp_path):
    """A uv another uid put in the caller's cache (with a record that matches) is not run, but installed again."""
    xdg, marker = tmp_path / "xdg", tmp_path / "planted_uv_ran"
    uv = xdg / "cat" / "uv" / "bin" / "uv"
    _plant(uv, marker, record=True)
    for path in (uv, uv.parent / "uv.sha256", uv.parent, uv.parent.parent):
        os.chown(path, 4242, 4242)
    run = _setup(checkout, xdg)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not marker.exists(), "the planted uv ran"
    assert f"ignoring the cached {xdg / 'cat' / 'uv'}" in run.stderr
    assert uv.stat().st_uid == 0 and not uv.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)
