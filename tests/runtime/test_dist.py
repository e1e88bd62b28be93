"""Process-group helpers that hold without a group: the job's rendezvous port (the same rule in
Python and in the sbatch templates), a submitit job's rendezvous (real stores on the loopback) and where
the ranks run."""

from __future__ import annotations

import socket
import subprocess
import threading
from datetime import timedelta

import pytest

from cat.errors import UserError
from cat.runtime import DistEnv
from cat.runtime.dist import _rendezvous, describe_hosts, hosts_by_rank, rendezvous_port
from tests.conftest import REPO


def test_rendezvous_port_is_the_templates_and_differs_per_job(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "123457")
    bash = subprocess.run(
        ["bash", "-c", f"source {REPO / 'scripts/slurm/common.sh'} >/dev/null && rendezvous_port"],
        env={"SLURM_JOB_ID": "123457", "SLURM_SUBMIT_DIR": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert rendezvous_port("123457_0") == int(bash.stdout) == 20000 + 123457 % 12000
    monkeypatch.setenv("SLURM_JOB_ID", "123458")
    assert rendezvous_port("123457_0") == int(bash.stdout) + 1
    monkeypatch.delenv("SLURM_JOB_ID")  # submitit's local executor: a checksum of its id, in range
    ports = {rendezvous_port(f"local-{i}") for i in range(50)}
    assert len(ports) > 45 and all(20000 <= port < 32000 for port in ports)


def test_describe_hosts_single_process():
    assert describe_hosts(DistEnv()) == f"{socket.gethostname()} (rank 0)"


def test_hosts_by_rank_names_each_host_once_with_its_ranks():
    assert hosts_by_rank(["n1"] * 8 + ["n2"] * 8) == "n1 (ranks 0-7), n2 (ranks 8-15)"
    assert hosts_by_rank(["n1", "n2", "n1"]) == "n1 (ranks 0,2), n2 (rank 1)"


@pytest.fixture
def port_held_by_a_connection():
    """A port an outgoing connection holds (as Linux hands them out): no rendezvous can listen on it."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        accepted, _ = server.accept()
        with accepted:
            yield client.getsockname()[1]


def test_a_rendezvous_whose_port_is_taken_ends_every_rank_in_one_line(monkeypatch, port_held_by_a_connection):
    port = port_held_by_a_connection
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with pytest.raises(UserError, match=f"rank 0 could not open the job's rendezvous on port {port} .*MASTER_PORT="):
        _rendezvous(0, 2, timedelta(seconds=2))
    # The other rank waits for rank 0's store only its bound, then names the address and what to look at.
    with pytest.raises(
        UserError, match=f"rank 1 of 2 could not reach the job's rendezvous at 127.0.0.1:{port} within 2 s"
    ):
        _rendezvous(1, 2, timedelta(seconds=2))


def test_ranks_meet_at_the_rendezvous_and_form_the_group(monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    stores: dict[int, object] = {}
    threads = [
        threading.Thread(target=lambda r=r: stores.__setitem__(r, _rendezvous(r, 2, timedelta(seconds=30))))
        for r in (0, 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stores[0].set("from rank 0", "hello")
    assert stores[1].get("from rank 0") == b"hello"
