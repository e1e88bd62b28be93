"""The sbatch templates under a real one-node Slurm (scripts/slurm/local_cluster.sh): a job runs,
a preempted job checkpoints mid-epoch, is requeued and ends with an uninterrupted run's weights."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.classification.test_train_cls import env_single_thread, final_weights
from tests.conftest import REPO, TINY_CLS

pytestmark = pytest.mark.slow
# Long enough per epoch (179 steps of a few ms) to be signalled in the middle of one.
DIGITS = [
    "data=digits",
    "data.img_size=64",
    "model.kwargs={embed_dim:32,depth:2,patch_size:4}",
    "aug=none",
    "workers=0",
    "logger.wandb.mode=disabled",
    "batch_size=8",
    "log_interval=5",
    "epochs=2",
]
SYNTHETIC = [
    *TINY_CLS,
    "batch_size=8",
    "epochs=2",
]
CPU_JOB = ["--gpus-per-node=0", "--cpus-per-task=1"]


@pytest.fixture(scope="module")
def slurm() -> None:
    if os.geteuid() != 0 or shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        pytest.skip("a local Slurm needs root and Debian's slurm-wlm/munge packages")
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "slurm" / "local_cluster.sh"), "start"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        pytest.skip(f"the local Slurm daemons could not start: {proc.stderr.strip().splitlines()[-1:]}")


def sbatch(template: str, log: Path, *args: str, options: tuple[str, ...] = ()) -> str:
    proc = subprocess.run(
        [
            "sbatch",
            "--parsable",
            *CPU_JOB,
            *options,
            f"--output={log}",
            str(REPO / "scripts" / "slurm" / template),
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env=env_single_thread(),
    )
    return proc.stdout.strip().split(";")[0]


def job_field(job: str, field: str) -> str | None:
    proc = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True)
    match = re.search(rf"\b{field}=(\S+)", proc.stdout)
    return match.group(1) if match else None


def wait_for(job: str, timeout: float = 900) -> str:
    """The job's final state. A requeued job is made eligible soon after it is requeued (Slurm
    delays requeued jobs by minutes), but not at once: started while slurmd is still cleaning up the
    previous run, the batch job is killed ("job credential revoked") and the job ends FAILED."""
    deadline = time.time() + timeout
    requeued_at = None
    while time.time() < deadline:
        state = job_field(job, "JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        if state == "PENDING" and int(job_field(job, "Restarts") or 0) > 0:
            requeued_at = requeued_at or time.time()
            if time.time() - requeued_at > 5:
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)
        time.sleep(1)
    raise TimeoutError(f"job {job} did not finish in {timeout} s")


def test_single_node_runs_the_quickstart_kind_of_job(slurm, tmp_path):
    job = sbatch(
        "single_node.sbatch", tmp_path / "job.out", "train_cls.py", *SYNTHETIC, f"output_dir={tmp_path / 'run'}"
    )
    assert wait_for(job) == "COMPLETED", (tmp_path / "job.out").read_text()[-3000:]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["epoch"] == 2


def test_multi_node_template_on_one_node(slurm, tmp_path):
    job = sbatch(
        "multi_node.sbatch",
        tmp_path / "job.out",
        "train_cls.py",
        *SYNTHETIC,
        f"output_dir={tmp_path / 'run'}",
        options=("--nodes=1",),
    )
    assert wait_for(job) == "COMPLETED", (tmp_path / "job.out").read_text()[-3000:]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["epoch"] == 2


def test_preempted_job_checkpoints_mid_epoch_requeues_and_matches(slurm, tmp_path):
    out, log = tmp_path / "run", tmp_path / "job.out"
    job = sbatch("single_node.sbatch", log, "train_cls.py", *DIGITS, f"output_dir={out}")
    deadline = time.time() + 300
    while not re.search(
        r"epoch 1/2 step (2\d|[3-9]\d)/179", (out / "log.txt").read_text() if (out / "log.txt").exists() else ""
    ):
        assert time.time() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    assert wait_for(job) == "COMPLETED", log.read_text()[-3000:]
    text = log.read_text()
    assert "requeueing job" in text and int(job_field(job, "Restarts")) == 1
    resumed = re.search(r"resumed from .*last\.pth: epoch 1, step (\d+) of 179", text)
    assert resumed and 20 <= int(resumed.group(1)) < 179, text[-3000:]
    reference = tmp_path / "reference"  # the same job, uninterrupted, outside Slurm
    subprocess.run(
        [sys.executable, str(REPO / "train_cls.py"), *DIGITS, f"output_dir={reference}"],
        cwd=REPO,
        env=env_single_thread(),
        check=True,
        capture_output=True,
        timeout=600,
    )
    expected = final_weights(reference)
    got = final_weights(out)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_segmentation_job_through_sbatch(slurm, toy_ade, tmp_path):
    pytest.importorskip("mmseg", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")
    job = sbatch(
        "single_node.sbatch",
        tmp_path / "job.out",
        "train_seg.py",
        f"data.root={toy_ade}",
        f"output_dir={tmp_path / 'run'}",
        "schedule.iters=2",
        "schedule.val_interval=2",
        "logger.wandb.mode=disabled",
        "log_interval=1",
        "workers=0",
    )
    assert wait_for(job) == "COMPLETED", (tmp_path / "job.out").read_text()[-3000:]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["mIoU"] is not None
