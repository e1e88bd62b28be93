from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def run_entry(script: str, *overrides: str, nproc: int = 1, timeout: int = 900) -> subprocess.CompletedProcess:
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([*launcher, str(REPO / script), *overrides], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def _toy_dataset(tmp_path_factory, tool: str) -> Path:
    root = tmp_path_factory.mktemp(tool)
    subprocess.run([sys.executable, str(REPO / "tools" / f"make_{tool}.py"), str(root), "--train", "8", "--val", "4"],
                   check=True, capture_output=True)
    return root


@pytest.fixture(scope="session")
def toy_coco(tmp_path_factory) -> Path:
    return _toy_dataset(tmp_path_factory, "toy_coco")


@pytest.fixture(scope="session")
def toy_ade(tmp_path_factory) -> Path:
    return _toy_dataset(tmp_path_factory, "toy_ade")
