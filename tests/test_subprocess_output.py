"""A test whose command fails shows what the command printed, not only its exit status: pytest run on a test file
of its own with the hook of ``tests/subprocess_output.py``, its failure report read."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

FAILING = """
import subprocess, sys

def test_check_true():
    script = "import sys; print('made 3 of 4'); sys.exit('script.sh: node cat-n2 is down')"
    subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)

def test_timeout_under_a_later_error():
    try:
        subprocess.run([sys.executable, "-c", "import time; print('waiting on the job', flush=True); time.sleep(30)"],
                       capture_output=True, timeout=3)
    except subprocess.TimeoutExpired:
        raise AssertionError("the job never ended")

def test_passes():
    subprocess.run([sys.executable, "-c", "print('fine')"], capture_output=True, check=True)
"""


def test_a_failed_commands_last_lines_are_in_the_failure(tmp_path):
    (tmp_path / "test_failing.py").write_text(FAILING)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.subprocess_output",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-o",
            "addopts=",
            "test_failing.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert "2 failed, 1 passed" in proc.stdout, proc.stdout[-3000:]
    sections = proc.stdout.split("output of the failed command (call)")
    assert len(sections) == 3, proc.stdout[-3000:]  # one per failed test, none for the passing one
    assert "script.sh: node cat-n2 is down" in sections[1] and "made 3 of 4" in sections[1]
    assert "waiting on the job" in sections[2]  # a timed-out command's output so far, under the error it caused
