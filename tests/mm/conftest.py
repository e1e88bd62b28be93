from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests import prewarmed
from tests.conftest import REPO, descendant_pids


def run_entry(script: str, *overrides: str, nproc: int = 1, timeout: int = 900) -> subprocess.CompletedProcess:
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2")}
    proc = prewarmed.run(
        [*launcher, str(REPO / script), *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def stop_like_slurm(script: str, overrides: list[str], log: Path, reached: str) -> tuple[int, str]:
    """Start ``script``, wait until its ``log`` matches the regex ``reached``, then SIGTERM the trainer and
    every process below it (its DataLoader workers), as Slurm signals a job step: (the trainer's exit status
    once it ends, its stderr), after asserting it had two workers."""
    with tempfile.TemporaryFile() as stderr:  # a file, not a pipe: a full pipe would stall the trainer
        first = prewarmed.Popen(
            [sys.executable, str(REPO / script), *overrides], cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr
        )
        deadline = time.monotonic() + 600
        while not re.search(reached, log.read_text() if log.exists() else ""):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        workers = descendant_pids(first.pid)
        assert len(workers) == 2  # the train loader's
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        first.send_signal(signal.SIGTERM)
        status = first.wait(timeout=300)
        stderr.seek(0)
        return status, stderr.read().decode()
