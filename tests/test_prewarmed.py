"""The prewarmed children (tests/prewarmed.py): torchrun stays a process of its own and its workers are forked, a
shim killed outright takes its forked command with it, as the killed process would have ended, and a command past
its timeout ends with its output kept and its own commands ended; a forked command's CPU time comes back to the
process that waited for it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import prewarmed
from tests.conftest import REPO

pytestmark = pytest.mark.skipif(
    os.environ.get("CAT_TEST_FORK") == "0", reason="CAT_TEST_FORK=0: every command starts a fresh interpreter"
)
# What a rank writes: whether it started with the stack already imported (forked), and its own process.
RANK_SCRIPT = """
import json, os, sys
record = {"forked": "timm" in sys.modules, "pid": os.getpid(), "ppid": os.getppid()}
with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as f:
    json.dump(record, f)
"""


@pytest.mark.slow
def test_torchrun_is_its_own_process_and_its_workers_are_forked(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    proc = prewarmed.Popen([*command, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert isinstance(proc, subprocess.Popen)  # torchrun itself: a fresh interpreter
    assert proc.wait(timeout=300) == 0, proc.stdout.read().decode()[-3000:]
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in ("0", "1")]
    assert [rank["forked"] for rank in ranks] == [True, True]
    assert len({rank["pid"] for rank in ranks} | {proc.pid}) == 3


def test_a_shim_killed_outright_takes_its_command_with_it(tmp_path):
    """The shim runs ``python -c`` forked; SIGKILL to the shim (as torchrun's last resort) ends the command too."""
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)"
    starter = f"import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', {code!r}]).pid, flush=True)"
    parent = prewarmed.Popen(
        [sys.executable, "-c", starter + "; import time; time.sleep(300)"],
        cwd=REPO,
        env={**os.environ, "CAT_TEST_FORK_CHILDREN": "1"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        shim = int(parent.stdout.readline())
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        command = int(pid_file.read_text())
        assert command != shim and Path(f"/proc/{command}").exists()
        os.kill(shim, signal.SIGKILL)
        while Path(f"/proc/{command}").exists() and _state(command) != "Z":
            assert time.monotonic() < deadline, "the command outlived its shim"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()


def _state(pid: int) -> str:
    """The process state letter of ``pid`` (Z: ended, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "Z"


def test_a_command_past_its_timeout_ends_with_what_it_printed_and_takes_its_commands_with_it(tmp_path):
    """As ``subprocess.run``: the timeout's error carries the output so far (the failure report shows it), and what
    the command started (here a forked grandchild through the shim) ends with it instead of running on unseen."""
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)"
    starter = (
        f"import os, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {code!r}])\n"
        f"path = {str(pid_file)!r}\nwhile not (os.path.exists(path) and os.path.getsize(path)): time.sleep(0.05)\n"
        "print('waiting on it', flush=True); time.sleep(300)"
    )
    env = {**os.environ, "CAT_TEST_FORK_CHILDREN": "1"}
    with pytest.raises(subprocess.TimeoutExpired) as timeout:
        prewarmed.run(
            [sys.executable, "-c", starter],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=20,
        )
    assert timeout.value.stdout == "waiting on it\n"
    grandchild, deadline = int(pid_file.read_text()), time.monotonic() + 60
    while Path(f"/proc/{grandchild}").exists() and _state(grandchild) != "Z":
        assert time.monotonic() < deadline, "the command's own command outlived the timeout"
        time.sleep(0.05)


def test_a_forked_commands_cpu_time_comes_back_to_the_process_that_waited():
    """tests/cpu_time.py counts a forked command's CPU to its test: the server returns it with the exit status."""
    burn = "import time\nstart = time.process_time()\nwhile time.process_time() - start < 0.3: pass"
    before = prewarmed.forked_cpu_s
    prewarmed.run([sys.executable, "-c", burn], cwd=REPO, check=True, timeout=60)
    assert prewarmed.forked_cpu_s - before >= 0.3
