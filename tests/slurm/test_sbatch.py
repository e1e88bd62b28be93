"""The sbatch templates and the Slurm launcher under a real Slurm (scripts/slurm/local_cluster.sh): two nodes,
each its own network host in a namespace of this machine (one node, this host, where namespaces cannot be
made). A job runs; a preempted job checkpoints mid-epoch, is requeued and ends with an uninterrupted run's
weights, and its trainers may take longer than torchrun's default 30 s to save; two nodes train as two
processes on one; two jobs share the nodes; a lost node ends its job in bounded time and the requeued job
resumes; and `stop` leaves nothing behind.

All in one file: one cluster, its tests in order, never two workers at once."""

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

from tests import prewarmed
from tests.classification.test_train_cls import env_single_thread, final_weights
from tests.conftest import REPO, TINY_CLS, run_folder

pytestmark = pytest.mark.slow
CLUSTER = ["bash", str(REPO / "scripts" / "slurm" / "local_cluster.sh")]
STATE = Path(os.environ.get("CAT_SLURM_DIR", "/tmp/cat-slurm"))  # the cluster's state folder: its daemons' logs
NODES = ("cat-n1", "cat-n2")
# Long enough per epoch (179 steps of a few ms; 89 on two ranks) to be signalled in the middle of one.
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
# How long a test waits for its job: about five times what the job took under the full suite's load on 2 cores (a
# SYNTHETIC job 5-10 s, a DIGITS job or a detection job 20-40 s; a requeued job also waits for its node and its
# restart), never the blanket 900 s that made a job pending on a lost node cost a quarter of an hour.
SHORT_JOB_S = 120
LONG_JOB_S = 240
REQUEUED_JOB_S = 360
TWO_NODES = ("--nodes=2",)


def cluster(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([*CLUSTER, *args], capture_output=True, text=True, timeout=300, check=check)


@pytest.fixture(scope="module")
def slurm() -> int:
    """The local cluster's node count: 2, or 1 where network namespaces cannot be made here."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        pytest.skip("a local Slurm needs root and Debian's slurm-wlm/munge packages")
    proc = cluster("start", "--nodes", "2", check=False)
    if proc.returncode == 0:
        return 2
    cluster("stop", check=False)
    one = cluster("start", check=False)
    if one.returncode != 0:
        pytest.skip(f"the local Slurm daemons could not start: {one.stderr.strip().splitlines()[-1:]}")
    return 1


def node_log_tail(node: str, lines: int = 5) -> str:
    """The last lines of ``node``'s slurmd log in the cluster's state folder."""
    log = STATE / (f"slurmd-{node}.log" if node.startswith("cat-n") else "slurmd.log")
    try:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:]) or "(empty)"
    except OSError as error:
        return f"(no log: {error.strerror})"


def unusable_nodes() -> dict[str, str]:
    """The cluster's nodes Slurm cannot run a job on now (down, drained, not responding: ``down*``, ``idle*``, ...),
    each with its state and the reason Slurm gives."""
    states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t %E"], capture_output=True, text=True, timeout=30)
    found = {}
    for line in states.stdout.splitlines():
        node, state, reason = (line.split(None, 2) + ["", ""])[:3]
        if state not in ("idle", "mix", "alloc"):
            found[node] = f"{state} ({reason.strip() or 'no reason given'})"
    if states.returncode != 0:
        found["controller"] = f"sinfo failed: {states.stderr.strip()[-300:]}"
    return found


def assert_nodes_usable() -> None:
    """Fails at once, naming each node Slurm cannot use and its slurmd log's end, instead of a test waiting on a job
    that cannot start."""
    down = unusable_nodes()
    if down:
        pytest.fail(
            "; ".join(
                f"node {node} is {state}; the end of its slurmd log: {node_log_tail(node)}"
                for node, state in down.items()
            ),
            pytrace=False,
        )


@pytest.fixture
def two_nodes(slurm: int) -> None:
    if slurm < 2:
        pytest.skip("a two-node local Slurm needs network namespaces (ip netns), which could not be made here")
    assert_nodes_usable()


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


def scontrol_field(kind: str, name: str, field: str) -> str | None:
    """``field`` of ``scontrol show <kind> <name>`` (a job or a node)."""
    proc = subprocess.run(["scontrol", "show", kind, name], capture_output=True, text=True, timeout=30)
    match = re.search(rf"\b{field}=(\S+)", proc.stdout)
    return match.group(1) if match else None


def job_field(job: str, field: str) -> str | None:
    return scontrol_field("job", job, field)


FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
# A pending job's reasons that say it waits on a node Slurm cannot use now.
NODE_UNAVAILABLE = re.compile(r"DOWN|DRAIN|NodeDown|ReqNodeNotAvail|NodeNotAvail")


def fail_if_waiting_on_a_lost_node(job: str, state: str | None) -> None:
    """Ends the test (and the job) at once where ``job`` is pending on a node Slurm cannot use, naming the node, its
    state and its slurmd log's end; a reason Slurm left from before, with every node usable again, is no cause."""
    if state != "PENDING":
        return
    reason = job_field(job, "Reason") or ""
    if NODE_UNAVAILABLE.search(reason) and (down := unusable_nodes()):
        subprocess.run(["scancel", job], capture_output=True)
        pytest.fail(
            f"job {job} is pending ({reason}) on what Slurm cannot use: "
            + "; ".join(f"{node} is {what}; its slurmd log ends: {node_log_tail(node)}" for node, what in down.items()),
            pytrace=False,
        )


def wait_for(job: str, timeout: float) -> str:
    """The job's final state, waiting at most ``timeout`` s (a few times the job's measured length), and not at all
    once it is pending on a node Slurm cannot use. A requeued job is made eligible soon after it is requeued (Slurm
    delays requeued jobs by minutes), but not at once: started while slurmd is still cleaning up the previous run,
    the batch job is killed ("job credential revoked") and the job ends FAILED."""
    deadline = time.monotonic() + timeout
    requeued_at = None
    while time.monotonic() < deadline:
        state = job_field(job, "JobState")
        if state in FINAL_STATES:
            return state
        fail_if_waiting_on_a_lost_node(job, state)
        if state == "PENDING" and int(job_field(job, "Restarts") or 0) > 0:
            requeued_at = requeued_at or time.monotonic()
            if time.monotonic() - requeued_at > 5:
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)
        time.sleep(1)
    subprocess.run(["scancel", job], capture_output=True)
    raise TimeoutError(
        f"job {job} did not finish in {timeout:.0f} s (state {job_field(job, 'JobState')}, "
        f"reason {job_field(job, 'Reason')})"
    )


def test_single_node_runs_the_quickstart_kind_of_job(slurm, tmp_path):
    job = sbatch(
        "single_node.sbatch", tmp_path / "job.out", "train_cls.py", *SYNTHETIC, f"output_dir={tmp_path / 'run'}"
    )
    assert wait_for(job, SHORT_JOB_S) == "COMPLETED", (tmp_path / "job.out").read_text()[-3000:]
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
    assert wait_for(job, SHORT_JOB_S) == "COMPLETED", (tmp_path / "job.out").read_text()[-3000:]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["epoch"] == 2


def wait_for_line(path: Path, pattern: str, job: str, timeout: float = LONG_JOB_S) -> re.Match:
    """The first match of ``pattern`` in ``path`` once ``job`` writes it (the file may not exist yet); fails at once
    where the job ended without it or waits on a lost node."""
    deadline = time.monotonic() + timeout
    while not (match := re.search(pattern, path.read_text() if path.exists() else "")):
        state = job_field(job, "JobState")
        assert state not in FINAL_STATES, f"job {job} ended {state} before {pattern!r} was in {path}"
        fail_if_waiting_on_a_lost_node(job, state)
        assert time.monotonic() < deadline, f"no {pattern!r} in {path} after {timeout} s (job {job}: {state})"
        time.sleep(0.2)
    return match


def local_run(output_dir: Path, args: list[str], nproc: int = 1) -> Path:
    """The same training outside Slurm: one process, or ``nproc`` on this host through torchrun."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    prewarmed.run(
        [sys.executable, *launcher, str(REPO / "train_cls.py"), *args, f"output_dir={output_dir}"],
        cwd=REPO,
        env=env_single_thread(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    return output_dir


def assert_same_weights(got: Path, expected: Path) -> None:
    reference = final_weights(expected)
    weights = final_weights(got)
    for key, value in reference.items():
        assert torch.equal(weights[key], value), key


@pytest.fixture(scope="module")
def digits_on_two_ranks(tmp_path_factory) -> Path:
    """DIGITS trained uninterrupted by two processes on one host: what the two-node jobs must end with."""
    return local_run(tmp_path_factory.mktemp("digits2") / "run", DIGITS, nproc=2)


# A trainer that takes longer to stop than torchrun's default 30 s: it finishes (a slow step, a large checkpoint
# written to a shared filesystem) 40 s after the stop signal. Its requeued run ends at once.
SLOW_TO_STOP = """
import os, signal, sys, time
if int(os.environ.get("SLURM_RESTART_COUNT", "0")):
    sys.exit(0)
stop = []
signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
open(sys.argv[1] + ".started", "w").close()
while not stop:
    time.sleep(0.1)
started = time.monotonic()
time.sleep(40)
with open(sys.argv[1] + ".saved", "w") as saved:
    saved.write(f"{time.monotonic() - started:.0f} s after the stop")
"""


def test_preempted_trainer_may_take_longer_than_torchruns_default_to_save(slurm, tmp_path):
    script, marker = tmp_path / "slow_to_stop.py", tmp_path / "trainer"
    script.write_text(SLOW_TO_STOP)
    job = sbatch("single_node.sbatch", tmp_path / "job.out", str(script), str(marker))
    deadline = time.monotonic() + 300
    while not marker.with_suffix(".started").exists():
        assert time.monotonic() < deadline and job_field(job, "JobState") in ("PENDING", "RUNNING")
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    assert wait_for(job, REQUEUED_JOB_S) == "COMPLETED", (tmp_path / "job.out").read_text()[-3000:]
    saved = marker.with_suffix(".saved")
    assert saved.is_file(), (tmp_path / "job.out").read_text()[-3000:]  # torchrun's 30 s would have killed it
    assert saved.read_text() == "40 s after the stop"


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
    assert wait_for(job, LONG_JOB_S) == "COMPLETED", (tmp_path / "job.out").read_text()[-3000:]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["mIoU"] is not None


def test_two_node_jobs_side_by_side_train_as_two_processes_on_one_node(two_nodes, tmp_path):
    """Two two-node jobs at once on the same two nodes (each its own rendezvous port), and the first
    ends exactly as two processes on one host with the same global batch."""
    runs = {seed: tmp_path / f"seed{seed}" for seed in (0, 1)}
    jobs = {
        seed: sbatch(
            "multi_node.sbatch",
            run.with_suffix(".out"),
            "train_cls.py",
            *SYNTHETIC,
            f"seed={seed}",
            f"output_dir={run}",
            options=TWO_NODES,
        )
        for seed, run in runs.items()
    }
    for seed, job in jobs.items():
        assert wait_for(job, SHORT_JOB_S) == "COMPLETED", runs[seed].with_suffix(".out").read_text()[-3000:]
    ports = {
        re.search(r"rendezvous cat-n1:(\d+)", run.with_suffix(".out").read_text()).group(1) for run in runs.values()
    }
    assert len(ports) == 2
    (start0, end0), (start1, end1) = ((job_field(job, "StartTime"), job_field(job, "EndTime")) for job in jobs.values())
    assert start0 < end1 and start1 < end0, "the two jobs did not run at the same time"
    for run in runs.values():
        assert "world size 2: cat-n1 (rank 0), cat-n2 (rank 1)" in (run / "log.txt").read_text()
    reference = local_run(tmp_path / "one_node", [*SYNTHETIC, "seed=0"], nproc=2)
    got, expected = (json.loads((path / "metrics.json").read_text()) for path in (runs[0], reference))
    for key in ("val/top1", "val/top5", "val/loss", "train/loss", "epoch"):
        assert got[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), key
    steps = re.compile(r"\d+ steps/epoch")
    assert steps.findall((runs[0] / "log.txt").read_text()) == steps.findall((reference / "log.txt").read_text())
    weights, reference_weights = final_weights(runs[0]), final_weights(reference)
    for key, value in reference_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-6, atol=1e-7)


def test_preempted_job_checkpoints_mid_epoch_once_requeues_and_matches(slurm, request, tmp_path):
    """On every node the cluster has (two, or one where namespaces cannot be made), submitted with resume=false over
    an earlier run: the job starts the folder over once; a stop mid-epoch saves one checkpoint holding every rank's
    state; the requeued job goes on with what it trained, not starting over again, to the uninterrupted run's
    weights. (The single-node template's requeue: the slow-to-save test above.)"""
    assert_nodes_usable()
    steps = 179 // slurm  # an epoch's steps on each of the job's ranks
    out, log = run_folder(tmp_path / "run"), tmp_path / "job.out"
    (out / "metrics.jsonl").write_text("{}\n")  # an earlier run's record
    job = sbatch(
        "multi_node.sbatch",
        log,
        "train_cls.py",
        *DIGITS,
        f"output_dir={out}",
        "resume=false",
        options=(f"--nodes={slurm}",),
    )
    wait_for_line(out / "log.txt", rf"epoch 1/2 step (2\d|[3-8]\d)/{steps}", job)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    assert wait_for(job, REQUEUED_JOB_S) == "COMPLETED", log.read_text()[-3000:]
    text, record = log.read_text(), (out / "log.txt").read_text()
    assert int(job_field(job, "Restarts")) == 1 and "requeueing job" in text
    saved = re.findall(rf"stop requested \(signal\): saved epoch 1 step (\d+)/{steps}", record)
    assert len(saved) == 1 and 20 <= int(saved[0]) < steps, record  # one checkpoint, written once
    if slurm == 2:
        assert f"rank 1: stop requested, leaving with every rank at epoch 1 step {saved[0]}/{steps}" in text
    assert re.search(rf"resumed from .*last\.pth: epoch 1, step {saved[0]} of {steps}", record), record
    assert f"restart 1) on {slurm} nodes" in text
    assert f"started over by Slurm job {job}, now in its restart 1 (requeued); it goes on with that run" in text
    assert "resume: False -> True" not in text  # the same run, not a changed config
    [earlier] = (out / "earlier_runs").iterdir()
    assert [p.name for p in earlier.iterdir()] == ["metrics.jsonl"]
    reference = request.getfixturevalue("digits_on_two_ranks") if slurm == 2 else local_run(tmp_path / "one", DIGITS)
    assert_same_weights(out, reference)


def test_lost_node_ends_the_job_in_bounded_time_and_the_requeued_job_resumes(two_nodes, digits_on_two_ranks, tmp_path):
    """cat-n2 vanishes mid-epoch 2 (its network first, then every process on it). Rank 0 gives up
    after dist_timeout_s in its collective and says so in output_dir; Slurm marks the node down and
    requeues the job; the node comes back and the job resumes from epoch 1's checkpoint."""
    out, log = tmp_path / "run", tmp_path / "job.out"
    timeout_s = 30
    job = sbatch(
        "multi_node.sbatch",
        log,
        "train_cls.py",
        *DIGITS,
        f"dist_timeout_s={timeout_s}",
        f"output_dir={out}",
        options=TWO_NODES,
    )
    wait_for_line(out / "log.txt", r"epoch 2/2 step (2\d|[3-8]\d)/89", job)
    lost = time.monotonic()
    try:
        cluster("fail", "cat-n2")
        while job_field(job, "JobState") in ("RUNNING", "COMPLETING") and time.monotonic() - lost < 300:
            time.sleep(0.5)
        ended = time.monotonic() - lost
        # The bound: the collective's timeout or Slurm's SlurmdTimeout (20 s here), whichever comes first,
        # then up to KillWait (20 s here) while srun waits for the lost node's step, and a margin.
        assert ended < timeout_s + 20 + 30, f"the job still ran {ended:.0f} s after its node was lost"
        state = job_field(job, "JobState")
        assert state in ("PENDING", "NODE_FAIL", "FAILED"), state
        record = (out / "log.txt").read_text()
        assert "a collective failed, another rank stopped answering" in record, record[-2000:]
        checkpoint = torch.load(out / "last.pth", map_location="cpu", weights_only=True)
        assert (checkpoint["epoch"], checkpoint["step_in_epoch"]) == (0, 0)  # epoch 1 (0-based 0), whole
    finally:
        cluster("start", "--nodes", "2")
    if state != "PENDING":  # not requeued by Slurm: resubmit
        job = sbatch("multi_node.sbatch", log, "train_cls.py", *DIGITS, f"output_dir={out}", options=TWO_NODES)
    assert wait_for(job, REQUEUED_JOB_S) == "COMPLETED", log.read_text()[-3000:]
    assert re.search(r"resumed from .*last\.pth: epoch 2, step 0 of 89", (out / "log.txt").read_text())
    assert_same_weights(out, digits_on_two_ranks)


def node_processes(node: str) -> set[str]:
    """The PIDs of what runs in ``node``'s network namespace (its slurmd, between jobs)."""
    return set(subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True, timeout=30).stdout.split())


def idle_cores(seconds: float = 1.0) -> float:
    """How many cores' worth of time the machine leaves idle over the next ``seconds`` (``/proc/stat``)."""

    def times() -> tuple[int, int]:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return sum(values), values[3] + values[4]  # all, idle + iowait

    total, idle = times()
    time.sleep(seconds)
    total_after, idle_after = times()
    return (os.cpu_count() or 1) * (idle_after - idle) / max(1, total_after - total)


def test_a_lost_node_comes_back_at_every_start_with_the_cores_busy(two_nodes):
    """`fail` then `start` ten times in a row while every core is busy (the suite's own load made `start` fail, or
    return with the node still dead): each time `start` returns once the controller holds the new slurmd's
    registration, and the node runs a job step after, on a slurmd started anew. Busy
    loops take the cores the machine leaves idle: all of them when the test runs alone, none while the suite's
    other workers already keep every core busy (they would only slow those down)."""
    burners = round(idle_cores())
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    try:
        for round_ in range(10):
            before = node_processes("cat-n2")
            registered = scontrol_field("node", "cat-n2", "SlurmdStartTime")
            cluster("fail", "cat-n2")
            cluster("start", "--nodes", "2")
            # As `start` returns, the controller holds the new slurmd's registration, not the lost one's.
            assert scontrol_field("node", "cat-n2", "SlurmdStartTime") != registered, f"round {round_}"
            step = subprocess.run(
                ["srun", "-w", "cat-n2", "-N1", "-n1", "--gpus-per-node=0", "hostname"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert step.stdout.strip() == "cat-n2", f"round {round_}: {step.stdout} {step.stderr}"
            assert before and not before & node_processes("cat-n2"), f"round {round_}: the lost slurmd still runs"
    finally:
        for process in busy:
            process.kill()
            process.wait()


def test_a_downed_node_ends_the_next_two_node_test_at_once_naming_it(two_nodes, tmp_path):
    """An administrator downs cat-n2: the next two-node test's check fails naming it and its slurmd log's end, and
    a job pending on it ends its wait at once with the reason, both within seconds, not after a job's timeout."""
    subprocess.run(
        ["scontrol", "update", "nodename=cat-n2", "state=down", "reason=downed by the test"], check=True, timeout=30
    )
    try:
        started = time.monotonic()
        with pytest.raises(pytest.fail.Exception) as checked:
            assert_nodes_usable()
        assert "node cat-n2 is down (downed by the test); the end of its slurmd log:" in str(checked.value)
        job = sbatch("multi_node.sbatch", tmp_path / "job.out", "train_cls.py", *SYNTHETIC, options=TWO_NODES)
        with pytest.raises(pytest.fail.Exception) as waited:
            wait_for(job, LONG_JOB_S)
        assert time.monotonic() - started < 30
        assert f"job {job} is pending (" in str(waited.value) and "cat-n2 is down" in str(waited.value)
        assert job_field(job, "JobState") == "CANCELLED"
    finally:
        subprocess.run(["scontrol", "update", "nodename=cat-n2", "state=resume"], check=True, timeout=30)
    deadline = time.monotonic() + 60
    while unusable_nodes():
        assert time.monotonic() < deadline, unusable_nodes()
        time.sleep(1)


def test_slurm_launcher_sweep_cells_on_two_nodes(two_nodes, tmp_path):
    sweep = tmp_path / "sweep"
    prewarmed.run(
        [
            sys.executable,
            str(REPO / "train_cls.py"),
            "-m",
            "hydra/launcher=slurm",
            "cluster.nodes=2",
            "cluster.gpus_per_node=0",
            "cluster.tasks_per_node=1",
            "cluster.cpus_per_task=1",
            "cluster.time_min=10",
            *SYNTHETIC,
            "seed=0,1",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=REPO,
        env=env_single_thread(),
        check=True,
        capture_output=True,
        timeout=LONG_JOB_S,
    )
    cells = sorted(path.parent for path in sweep.glob("*/metrics.json"))
    assert [cell.name.rsplit("seed=", 1)[1] for cell in cells] == ["0", "1"]
    for cell in cells:
        assert json.loads((cell / "metrics.json").read_text())["epoch"] == 2
        assert "world size 2: cat-n1 (rank 0), cat-n2 (rank 1)" in (cell / "log.txt").read_text()


def test_detection_on_two_nodes(two_nodes, toy_coco, tmp_path):
    pytest.importorskip("mmdet", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")
    log = tmp_path / "job.out"
    job = sbatch(
        "multi_node.sbatch",
        log,
        "train_det.py",
        f"data.root={toy_coco}",
        f"output_dir={tmp_path / 'run'}",
        "schedule.epochs=1",
        "logger.wandb.mode=disabled",
        "log_interval=1",
        "batch_size=2",
        "workers=0",
        options=TWO_NODES,
    )
    assert wait_for(job, LONG_JOB_S) == "COMPLETED", log.read_text()[-3000:]
    assert "world size 2: cat-n1 (rank 0), cat-n2 (rank 1)" in (tmp_path / "run" / "log.txt").read_text()
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["bbox_mAP_50"] is not None


def _decoys(tmp_path: Path) -> list[subprocess.Popen]:
    """Processes named like the daemons that are not the cluster's: a site's own Slurm or munge."""
    decoys = []
    for name in ("slurmctld", "slurmd", "munged"):
        shutil.copy(shutil.which("sleep"), tmp_path / name)
        decoys.append(subprocess.Popen([str(tmp_path / name), "600"]))
    return decoys


def test_stop_ends_only_its_own_daemons_and_leaves_no_namespace_or_bridge(slurm, tmp_path):
    """Last of the cluster's tests: the cluster is gone afterwards, a second stop is harmless, and processes
    named like its daemons that it did not start (pkill -x took a site's down) are still running."""
    decoys = _decoys(tmp_path)
    try:
        for _ in range(2):
            cluster("stop")
        assert [decoy.poll() for decoy in decoys] == [None, None, None]
    finally:
        for decoy in decoys:
            decoy.kill()
            decoy.wait()
    for daemon in ("slurmctld", "slurmd", "slurmstepd", "munged"):
        assert subprocess.run(["pgrep", "-x", daemon], capture_output=True).returncode == 1, daemon
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not re.search(r"^cat-n\d", netns, re.M), netns
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert "catslurm0" not in links and "cat-n" not in links, links
    addresses = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert "10.231.0." not in addresses
    assert (
        not Path("/etc/netns/cat-n1").exists() and not Path(os.environ.get("CAT_SLURM_DIR", "/tmp/cat-slurm")).exists()
    )


def test_a_start_whose_node_never_comes_up_ends_in_bounded_time_naming_it(slurm, tmp_path):
    """A slurmd that exits at once (here: one that is not Slurm's, first on PATH): start says which daemon did
    not come up, with its log's end, instead of waiting out a test's timeout; a stop then cleans up and a start
    after it works."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "slurmd").write_text("#!/bin/sh\necho 'fatal: this slurmd never starts' >&2\nexit 1\n")
    (fake / "slurmd").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    cluster("stop")  # the fixture's two-node cluster, when this test runs without the one before it
    started = time.monotonic()
    proc = subprocess.run([*CLUSTER, "start"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1 and time.monotonic() - started < 60, proc.stderr
    assert "local_cluster.sh: slurmd did not start: it exited with status 1" in proc.stderr, proc.stderr
    cluster("stop")
    cluster("start")  # check=True: a failure shows the script's own line (tests/subprocess_output.py)
    cluster("stop")
