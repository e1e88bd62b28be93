"""The stop signals every trainer shares: a flag while the job runs, then the signal back to the
handler it displaced (submitit's, which requeues), never a lost checkpoint."""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cat.runtime.preemption import Stopped, StopSignals, StopWhileWaiting, batches_until_stopped, stop_requested
from tests.conftest import REPO


def test_submitit_signal_is_a_flag_then_goes_back_to_submitit(monkeypatch):
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    handed_back = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: handed_back.append(signum))
    try:
        with StopSignals() as signals:
            assert not stop_requested()
            os.kill(os.getpid(), signal.SIGUSR2)
            assert stop_requested() and handed_back == []  # the job saves first
        assert not stop_requested()
        signals.hand_back()
        assert handed_back == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_sigterm_outside_submitit_is_caught_and_not_handed_to_the_default(monkeypatch):
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    with StopSignals() as signals:
        assert signals.signals == [signal.SIGTERM, signal.SIGINT]
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop_requested()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    signals.hand_back()  # the default handler would end the process: it is not called


def test_a_run_with_nothing_to_save_stops_at_once_and_leaves_submitits_signal(monkeypatch):
    """Evaluation and throughput runs: SIGTERM ends them (through an exception, so the folder is released),
    instead of a flag that no loop reads; submitit's signal keeps submitit's handler (it requeues)."""
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    submitit = signal.signal(signal.SIGUSR2, lambda signum, frame: None)
    try:
        with StopSignals(save=False) as signals:
            assert signals.signals == [signal.SIGTERM, signal.SIGINT]
            assert signal.getsignal(signal.SIGUSR2) is not signals._request
            with pytest.raises(Stopped, match="stopped by SIGTERM") as stopped:
                os.kill(os.getpid(), signal.SIGTERM)
            assert stopped.value.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR2, submitit)


def test_ctrl_c_is_a_flag_then_the_next_stops_at_once_and_the_run_exits_130(monkeypatch):
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop_requested()
        with pytest.raises(KeyboardInterrupt):  # the second, while the run finishes its step
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(SystemExit) as exited:
        signals.hand_back()
    assert exited.value.code == 130
    with StopSignals(save=False), pytest.raises(Stopped, match="stopped by SIGINT"):  # nothing to save: at once
        os.kill(os.getpid(), signal.SIGINT)
    # Started with Ctrl-C ignored (in the background, `cmd &` in a script): it stays ignored.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            assert not stop_requested()
    finally:
        signal.signal(signal.SIGINT, previous)


class _SignalsWhileFlushing(logging.StreamHandler):
    """A console handler that is sent SIGTERM while it writes a record: a stop arriving mid-log."""

    def flush(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        super().flush()


def test_a_stop_met_inside_code_that_catches_every_error_still_stops_the_run():
    """The handler raises Stopped wherever the run is: inside a log call (logging's handlers catch every Exception,
    print "--- Logging error ---" and go on: a throughput run then ran on after its SIGTERM) and inside an OmegaConf
    access (which raised it again as another type). Neither takes it."""
    from omegaconf import OmegaConf

    logger = logging.getLogger("test_preemption.stop_mid_log")
    logger.propagate = False
    logger.addHandler(_SignalsWhileFlushing(io.StringIO()))
    try:
        with StopSignals(save=False), pytest.raises(Stopped, match="stopped by SIGTERM"):
            logger.warning("throughput mode on")
    finally:
        logger.handlers.clear()

    def stop(_: str) -> None:
        raise Stopped(signal.SIGINT)

    OmegaConf.register_new_resolver("test_preemption_stop", stop)
    try:
        node = OmegaConf.create({"model": "${test_preemption_stop:now}"})
        with pytest.raises(Stopped) as stopped:
            node.model  # noqa: B018 (the access is the test)
        assert stopped.value.signum == signal.SIGINT and str(stopped.value) == "stopped by SIGINT"
    finally:
        OmegaConf.clear_resolver("test_preemption_stop")


# A trainer with two DataLoader workers: it prints their pids, waits for the stop signal, then takes
# the rest of its data and ends its workers itself, as multiprocessing does at exit.
TRAINER = """
import time
from torch.utils.data import DataLoader, Dataset
from cat.runtime.preemption import StopSignals, stop_requested, worker_context

class Slow(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        time.sleep(0.02)
        return i

with StopSignals():
    loader = DataLoader(Slow(), num_workers=2, persistent_workers=True, multiprocessing_context=worker_context(2))
    batches = iter(loader)
    items = [int(next(batches))]
    print("workers", *(w.pid for w in batches._workers), flush=True)
    while not stop_requested():
        time.sleep(0.01)
    items += [int(i) for i in batches]
    print("items", *items, flush=True)
    for worker in batches._workers:
        worker.terminate()
        worker.join(timeout=60)
    print("ended", *(w.exitcode for w in batches._workers), flush=True)
"""


@pytest.mark.slow  # worker processes and signals, end to end
def test_workers_outlast_a_stop_meant_for_their_trainer_and_end_on_its_own():
    """Slurm's stop signal reaches the trainer and its DataLoader workers alike: the workers go on
    serving the step the trainer finishes; the trainer's own SIGTERM still ends them, with status 0."""
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    workers = [int(pid) for pid in proc.stdout.readline().split()[1:]]
    assert len(workers) == 2, proc.stderr.read()
    for pid in [*workers, proc.pid]:
        os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Traceback" not in err, out + err
    assert out.splitlines() == ["items " + " ".join(map(str, range(24))), "ended 0 0"]


def _stuck_after(items: list[int], fifo: Path, delay: float = 0.0):
    """``items`` (each after ``delay`` seconds), then a read that never returns: a FIFO opened with no
    writer, as a hung file system's read blocks."""
    for item in items:
        time.sleep(delay)
        yield item
    with open(fifo, "rb") as f:
        yield f.read()


def test_a_stop_ends_a_wait_for_data_stuck_in_a_read(tmp_path):
    """One process: the stop ends the wait at once; before, the flag waited for a step that never came."""
    os.mkfifo(tmp_path / "stuck")
    got = []
    with StopSignals():
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(StopWhileWaiting, match=r"^SIGTERM while waiting 0 s for data$"):
            for batch in batches_until_stopped(_stuck_after([1, 2], tmp_path / "stuck")):
                got.append(batch)
    assert got == [1, 2] and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL


def test_a_rank_waits_its_grace_for_data_after_a_stop_then_leaves(tmp_path):
    """Several ranks: data that comes within the grace is taken (its peers may be finishing that step); a wait
    that outlasts it is abandoned, also one that began after the stop."""
    os.mkfifo(tmp_path / "stuck")
    got = []
    with StopSignals():
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(StopWhileWaiting, match=r"^SIGTERM while waiting 1 s for data$"):
            for batch in batches_until_stopped(_stuck_after([1, 2], tmp_path / "stuck", delay=0.4), grace=1.0):
                got.append(batch)
    assert got == [1, 2] and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
