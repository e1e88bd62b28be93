from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO


def run_entry(script: str, *overrides: str, nproc: int = 1, timeout: int = 900) -> subprocess.CompletedProcess:
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run(
        [*launcher, str(REPO / script), *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc
