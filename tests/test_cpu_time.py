"""``-p tests.cpu_time`` counts each test's CPU where it was spent: pytest run on a test file of its own, in one
process and under pytest-xdist's workers, its summary read."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

# Each burns 0.3 CPU-seconds (time.process_time: the same on a loaded machine), in the test or in a command it waits
# for; the marked one counts in the end-to-end tier.
BURNING = """
import subprocess, sys, time
import pytest

BURN = "import time\\nstart = time.process_time()\\nwhile time.process_time() - start < 0.3: pass"

def test_burns_its_own():
    exec(BURN)

@pytest.mark.slow
def test_burns_in_a_command():
    subprocess.run([sys.executable, "-c", BURN], check=True)

def test_idles():
    time.sleep(0.3)
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one_process", "xdist"])
def test_each_tests_cpu_is_counted_where_it_was_spent(tmp_path, workers):
    (tmp_path / "test_burning.py").write_text(BURNING)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.cpu_time", "-p", "no:cacheprovider", *workers]
        + ["-o", "addopts=", "-o", "markers=slow", "test_burning.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert "3 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stdout.split("CPU-seconds by test")[-1]
    rows = {
        name: (float(own), float(waited))
        for own, waited, name in re.findall(r"\(([\d.]+) \+ ([\d.]+)\)  test_burning\.py::(\w+)", summary)
    }
    assert set(rows) == {"test_burns_its_own", "test_burns_in_a_command", "test_idles"}, summary
    assert rows["test_burns_its_own"][0] >= 0.3 and rows["test_burns_its_own"][1] < 0.15, summary
    assert rows["test_burns_in_a_command"][1] >= 0.3, summary  # the command's, counted to the test that waited
    assert sum(rows["test_idles"]) < 0.15, summary
    assert re.search(r"end-to-end \(slow\): [\d.]+ s in 1 tests", summary), summary
    assert "in 3 tests:" in summary, summary
