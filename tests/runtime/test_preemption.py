"""The stop signals every trainer shares: a flag while the job runs, then the signal back to the
handler it displaced (submitit's, which requeues), never a lost checkpoint."""

from __future__ import annotations

import os
import signal

from cat.runtime.preemption import StopSignals, stop_requested


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
        assert signals.signals == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop_requested()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    signals.hand_back()  # the default handler would end the process: it is not called
