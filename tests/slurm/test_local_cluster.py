"""The local Slurm helper (scripts/slurm/local_cluster.sh) ends only what it started: a process named in a PID file
it did not write, a network namespace of one of its names that someone else made, a state folder others could
have planted, and an environment value that would run code are each left alone or refused, with real processes,
namespaces and bridges. None of these starts a cluster: each is refused, or touches nothing, before one would."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

CLUSTER = ["bash", str(REPO / "scripts" / "slurm" / "local_cluster.sh")]
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="the local cluster needs root and iproute2"
)


def _cluster(state: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLUSTER, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CAT_SLURM_DIR": str(state), **env},
    )


def _state(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir(mode=0o700, parents=True)
    return state


def _alive(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


@pytest.fixture
def foreign_namespace():
    """A namespace with one of the cluster's names, made by someone else, with a process inside."""
    name = "cat-n9"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
        pytest.skip("network namespaces cannot be made here")
    inside = subprocess.Popen(["ip", "netns", "exec", name, "sleep", "300"])
    time.sleep(0.3)
    yield name, inside
    inside.kill()
    inside.wait()
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_stop_and_fail_leave_what_they_did_not_start(tmp_path, foreign_namespace):
    name, inside = foreign_namespace
    state = _state(tmp_path)
    (state / ".cat-slurm-state").write_text("")  # the script's own folder, with PID files planted in it
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        for planted in ("sleep.pid", "slurmctld.pid", "munged.pid"):  # PID files the script never wrote
            (state / planted).write_text(f"{bystander.pid}\n")
        (state / "started").write_text(f"slurmctld sleep {bystander.pid} 1\n")  # a record whose start time lies
        stop = _cluster(state, "stop")
        assert stop.returncode == 0, stop.stderr
        fail = _cluster(state, "fail", name)
        assert fail.returncode != 0 and f"no node {name} of this cluster" in fail.stderr, fail.stderr
        assert _alive(bystander) and _alive(inside)
        assert name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert (state / "sleep.pid").is_file()  # a file it did not make stays, and so does its folder
    finally:
        bystander.kill()
        bystander.wait()


def test_an_environment_value_runs_nothing(tmp_path):
    state = _state(tmp_path)
    marker = tmp_path / "ran"
    for variable, value in (
        ("CAT_SLURM_START_S", f"HOST[$(touch {marker})]"),
        ("CAT_SLURM_START_S", "0"),
        ("CAT_SLURM_NET", f"10.0.0;touch {marker}"),
        ("CAT_SLURM_NET", "10.0.300"),
    ):
        proc = _cluster(state, "start", **{variable: value})
        assert proc.returncode != 0 and f"{variable} must be" in proc.stderr, proc.stderr
        assert not marker.exists() and os.listdir(state) == []
    proc = _cluster(state, "start", "--nodes", "1000")
    assert proc.returncode != 0 and "--nodes must be a number from 1 to 99" in proc.stderr


def test_a_state_folder_others_could_have_planted_is_refused(tmp_path):
    elsewhere = _state(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)
    for state, refusal in (
        (link, "is a symbolic link"),
        (open_folder, "may be written by others (drwxrwxrwx)"),
        (foreign, "belongs to uid 65534, not to you"),
    ):
        proc = _cluster(state, "status")
        assert proc.returncode == 1 and refusal in proc.stderr, proc.stderr
    made = tmp_path / "new" / "state"
    _cluster(made, "status")  # not running: exit 1, but its folder is made private
    assert oct(made.stat().st_mode & 0o777) == "0o700"


def test_an_existing_folder_the_script_did_not_make_is_refused_and_left_alone(tmp_path):
    """CAT_SLURM_DIR naming an existing folder of other files (as /var would): `start` refuses it and `stop` deletes
    none of its names (spool/, ctld/ are also names the script uses); a folder it made, or an empty one, is taken."""
    var = _state(tmp_path)
    for name in ("spool", "ctld", "lib"):
        (var / name).mkdir()
        (var / name / "keep").write_text(name)
    for command in ("stop", "start", "status"):
        proc = _cluster(var, command)
        assert proc.returncode == 1, proc.stderr
        assert f"{var} is not a folder this script made (no .cat-slurm-state; it holds lib)" in proc.stderr
    assert sorted(p.name for p in var.iterdir()) == ["ctld", "lib", "spool"]
    assert all((var / name / "keep").read_text() == name for name in ("spool", "ctld", "lib"))
    empty = _state(tmp_path / "empty")
    assert _cluster(empty, "status", CAT_SLURM_START_S="08").stdout.strip() == "not running"  # 08 read as 8
    assert (empty / ".cat-slurm-state").is_file()
    # A folder of only Slurm-looking names (as /var/log/slurm, or an older version's folder, which had no marker):
    # no command writes its marker, deletes spool/ with the user's files or the logs, or removes the folder.
    logs = _state(tmp_path / "slurm_logs")
    (logs / "spool").mkdir()
    (logs / "spool" / "mine.txt").write_text("the user's")
    for name in ("slurmctld.log", "jobcomp.txt"):
        (logs / name).write_text(name)
    for command in ("stop", "start", "status"):
        proc = _cluster(logs, command)
        assert proc.returncode == 1, proc.stderr
        assert f"{logs} holds only names this script uses" in proc.stderr and "nothing in it was touched" in proc.stderr
        assert f"remove it with: rm -rf -- '{logs}'" in proc.stderr
    assert sorted(p.name for p in logs.iterdir()) == ["jobcomp.txt", "slurmctld.log", "spool"]
    assert (logs / "spool" / "mine.txt").read_text() == "the user's" and (logs / "slurmctld.log").read_text()


def test_a_stale_record_of_a_namespace_since_made_again_by_someone_else_is_not_the_clusters(
    tmp_path, foreign_namespace
):
    """The cluster's record names cat-n9 with the inode of the namespace it made (here: one that no longer exists);
    a namespace of that name made since by someone else has another inode: `fail` refuses it and `stop` leaves
    it and its process alone. A record of the right inode is the cluster's own: `stop` ends it."""
    name, inside = foreign_namespace
    state = _state(tmp_path)
    (state / ".cat-slurm-state").write_text("")
    inode = os.stat(f"/var/run/netns/{name}").st_ino
    (state / "namespaces").write_text(f"{name} {inode + 1}\n")  # ours was another namespace of that name
    fail = _cluster(state, "fail", name)
    assert fail.returncode != 0 and f"no node {name} of this cluster" in fail.stderr, fail.stderr
    assert _cluster(state, "stop").returncode == 0
    assert _alive(inside) and name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    state.mkdir(mode=0o700, exist_ok=True)  # stop removed what it made, the folder too
    (state / ".cat-slurm-state").write_text("")
    (state / "namespaces").write_text(f"{name} {inode}\n")  # the record of this very namespace
    assert _cluster(state, "stop").returncode == 0
    inside.wait(timeout=30)  # its processes ended, the namespace deleted
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.fixture
def foreign_bridge():
    """A bridge of the name a cluster was told to use (CAT_SLURM_BRIDGE), made by someone else."""
    name = "catbrtest9"
    if subprocess.run(["ip", "link", "add", name, "type", "bridge"], capture_output=True).returncode != 0:
        pytest.skip("a bridge cannot be made here")
    yield name
    subprocess.run(["ip", "link", "del", name], capture_output=True)


def test_a_stale_record_of_a_bridge_since_made_again_by_someone_else_is_not_the_clusters(tmp_path, foreign_bridge):
    """As for namespaces: the record names the bridge with the interface index of the one the cluster made (here
    one since gone); a bridge of that name made since has another index and `stop` leaves it. A record of its own
    index is the cluster's: `stop` deletes it."""
    name = foreign_bridge
    state = _state(tmp_path)
    (state / ".cat-slurm-state").write_text("")
    index = int(Path(f"/sys/class/net/{name}/ifindex").read_text())
    (state / "bridge").write_text(f"{name} {index + 1000}\n")
    assert _cluster(state, "stop", CAT_SLURM_BRIDGE=name).returncode == 0
    assert Path(f"/sys/class/net/{name}").exists()
    state.mkdir(mode=0o700, exist_ok=True)
    (state / ".cat-slurm-state").write_text("")
    (state / "bridge").write_text(f"{name} {index}\n")
    assert _cluster(state, "stop", CAT_SLURM_BRIDGE=name).returncode == 0
    assert not Path(f"/sys/class/net/{name}").exists()
    bad = _cluster(state, "stop", CAT_SLURM_BRIDGE="cat;touch x")
    assert bad.returncode != 0 and "CAT_SLURM_BRIDGE must be an interface name" in bad.stderr
