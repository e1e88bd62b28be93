"""Process-group helpers that hold without a group: the job's rendezvous port (the same rule in
Python and in the sbatch templates) and where the ranks run."""

from __future__ import annotations

import socket
import subprocess

from cat.runtime import DistEnv
from cat.runtime.dist import describe_hosts, hosts_by_rank, rendezvous_port
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
    assert rendezvous_port("123457_0") == int(bash.stdout) == 20000 + 123457 % 20000
    monkeypatch.setenv("SLURM_JOB_ID", "123458")
    assert rendezvous_port("123457_0") == int(bash.stdout) + 1
    monkeypatch.delenv("SLURM_JOB_ID")  # submitit's local executor: a checksum of its id, in range
    ports = {rendezvous_port(f"local-{i}") for i in range(50)}
    assert len(ports) > 45 and all(20000 <= port < 40000 for port in ports)


def test_describe_hosts_single_process():
    assert describe_hosts(DistEnv()) == f"{socket.gethostname()} (rank 0)"


def test_hosts_by_rank_names_each_host_once_with_its_ranks():
    assert hosts_by_rank(["n1"] * 8 + ["n2"] * 8) == "n1 (ranks 0-7), n2 (ranks 8-15)"
    assert hosts_by_rank(["n1", "n2", "n1"]) == "n1 (ranks 0,2), n2 (rank 1)"
