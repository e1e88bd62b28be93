"""The signals that ask a job to stop cleanly, shared by every trainer.

SIGTERM (Slurm's preemption and requeue, ``scancel``, the sbatch templates), SIGINT (Ctrl-C, which a
terminal sends to the trainer and its DataLoader workers alike; a second one stops the run at once) and,
under submitit, its time-limit signal (``SUBMITIT_PREEMPT_SIGNAL``, USR2 by default) only set a flag; the
training loops poll :func:`stop_requested` once a step, save a checkpoint and return. A run stopped by
Ctrl-C then exits with status 130, as an interrupted command does, so a command chained after it does
not run. Submitit's own
handler for its signal (checkpoint the job description and requeue it) is called afterwards by
:meth:`StopSignals.hand_back`, once the run's checkpoint and record are written, so a requeued
cell resumes where it stopped instead of from its last epoch.

A stop that arrives while the loop waits for its next batch (:func:`batches_until_stopped`) does not wait
for a step that may never come (a read stuck on a hung file system, a FIFO): a single-process run leaves
the wait once it has lasted ``grace`` seconds after the stop (a batch that comes sooner is trained on, as
before), saves the steps it finished and returns; a rank of a multi-process run, whose peers may be inside a
step's collectives, leaves the same way but without saving (:class:`StopWhileWaiting`).

DataLoader workers started through :func:`worker_context` outlast a stop signal unless their trainer
itself sent it. torch's workers die on SIGTERM, and a stop reaches them with the trainer (torchrun
signals each trainer's process group, Slurm every process of a step), so the trainer lost its data in
the middle of the step it was finishing, and never saved. Such a worker is born with the stop signals
blocked (so every thread it ever runs blocks them), and one thread of it takes them: it ends the
worker on the trainer's own SIGTERM (how the DataLoader and multiprocessing end workers that outlive
their use) and lets any other pass. A worker follows its trainer if the trainer dies (torch's watchdog).
"""

from __future__ import annotations

import multiprocessing.context
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from .rng import capture_rng_state, restore_rng_state

T = TypeVar("T")

__all__ = ["StopSignals", "Stopped", "StopWhileWaiting", "batches_until_stopped", "stop_requested", "worker_context"]

_active: StopSignals | None = None


def stop_requested() -> bool:
    """Whether a stop signal arrived during the running job (False outside a job)."""
    return _active is not None and bool(_active.received)


def _submitit_signal() -> signal.Signals | None:
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return None
    return getattr(signal, f"SIG{os.environ.get('SUBMITIT_PREEMPT_SIGNAL', 'USR2')}", None)


def _stop_signals() -> list[signal.Signals]:
    """SIGTERM, SIGINT, and submitit's signal under submitit."""
    submitit = _submitit_signal()
    own = [signal.SIGTERM, signal.SIGINT]
    return own + ([submitit] if submitit is not None and submitit not in own else [])


def _end_on_the_trainers_signal(trainer: int, signals: set[signal.Signals]) -> None:
    while signal.sigwaitinfo(signals).si_pid != trainer:
        pass  # a stop meant for the trainer, which ends its workers itself when it is done
    # Status 0: the trainer ended its worker on purpose, and torch's SIGCHLD check (which can run before
    # multiprocessing reaps a worker at exit) reports any other status as a worker that failed.
    os._exit(0)


class _WorkerProcess(multiprocessing.context.ForkProcess):
    """A forked worker born with the stop signals blocked (module doc)."""

    def start(self) -> None:
        self.stop_signals = set(_stop_signals())  # the child gets a copy
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, self.stop_signals)  # the fork copies this mask too
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # one that came meanwhile is delivered now

    def run(self) -> None:
        waiter = threading.Thread(
            target=_end_on_the_trainers_signal, args=(os.getppid(), self.stop_signals), name="cat-stop", daemon=True
        )
        waiter.start()
        super().run()


class _WorkerContext(multiprocessing.context.ForkContext):
    Process = _WorkerProcess


def worker_context(workers: int) -> multiprocessing.context.BaseContext | None:
    """The ``multiprocessing_context`` for a DataLoader with ``workers`` worker processes: forked workers that
    outlast a stop meant for their trainer (module doc). None (the DataLoader's default) without workers (the
    DataLoader refuses a context then), and where fork is not the start method: spawned workers keep torch's
    behaviour."""
    return _WorkerContext() if workers > 0 and multiprocessing.get_start_method() == "fork" else None


class Stopped(BaseException):
    """A stop signal reached a run that has nothing to save (evaluation, throughput). A BaseException: the handler
    raises it wherever the run is, and code that catches every error would otherwise take it for one of its own
    (logging's handlers report it and go on, OmegaConf raises it again as another type)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class StopWhileWaiting(BaseException):
    """A stop signal arrived while the loop waited for data, and the wait was abandoned (module doc). A
    BaseException, so no ``except Exception`` on the way (the DataLoader's own) swallows it."""

    def __init__(self, signum: int, waited: float) -> None:
        super().__init__(f"{signal.Signals(signum).name} while waiting {waited:.0f} s for data")
        self.signum, self.waited = signum, waited


def batches_until_stopped(batches: Iterable[T], grace: float = 0.0) -> Iterator[T]:
    """``batches``, except that a stop signal arriving while the next one is awaited (or arriving before,
    and the wait lasting) ends the wait ``grace`` seconds later with :class:`StopWhileWaiting`. The RNG
    states are then put back as they were before the abandoned batch drew from them (its transforms, in
    this process), so a run resumed from the checkpoint saved next draws what the uninterrupted run did."""
    iterator = iter(batches)
    while True:
        before = capture_rng_state() if _active is not None else None
        if _active is not None:
            _active.wait_started(grace)
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except StopWhileWaiting:
            if before is not None:
                restore_rng_state(before)
            raise
        finally:
            if _active is not None:
                _active.wait_ended()
        yield batch


class StopSignals:
    """While active, the stop signals set a flag instead of ending the process (``save``: a training run,
    which saves and returns). A run with nothing to save stops at once, through :class:`Stopped` (so its
    folder is still released), and leaves submitit's signal to submitit."""

    def __init__(self, save: bool = True) -> None:
        self.save = save
        self.signals = _stop_signals() if save else [signal.SIGTERM, signal.SIGINT]
        self.submitit = _submitit_signal()
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}
        self._waiting_since: float | None = None  # when the loop began waiting for a batch, while it waits
        self._grace = 0.0

    def wait_started(self, grace: float) -> None:
        self._waiting_since, self._grace = time.monotonic(), grace
        if self.received:  # asked to stop during the step: the wait is already a wait after a stop
            self._abandon_wait_after(grace)

    def wait_ended(self) -> None:
        self._waiting_since = None
        if signal.getsignal(signal.SIGALRM) == self._waited_too_long:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)

    def _abandon_wait_after(self, grace: float) -> None:
        if grace <= 0:
            self._waited_too_long(self.received[-1], None)
        signal.signal(signal.SIGALRM, self._waited_too_long)
        signal.setitimer(signal.ITIMER_REAL, grace)

    def _waited_too_long(self, signum: int, frame: Any) -> None:
        if self._waiting_since is not None:
            since, self._waiting_since = self._waiting_since, None
            raise StopWhileWaiting(self.received[-1], time.monotonic() - since)

    def _request(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if not self.save:
            raise Stopped(signum)
        if signum == signal.SIGINT:  # the next Ctrl-C does what it did before: stop at once
            signal.signal(signal.SIGINT, self._previous[signal.SIGINT])
            # os.write, not print: a handler may run while the main thread is inside a print
            os.write(2, b"\nCtrl-C: the run finishes its step, saves and stops (Ctrl-C again stops it at once)\n")
        if self._waiting_since is not None:
            self._abandon_wait_after(self._grace)

    def __enter__(self) -> StopSignals:
        global _active
        for sig in self.signals:
            if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
                continue  # started in the background (nohup, `cmd &` in a script): Ctrl-C is not for this run
            self._previous[sig] = signal.signal(sig, self._request)
        _active = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        self.wait_ended()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        _active = None

    def hand_back(self) -> None:
        """Give submitit's signal, if it came, to the handler it displaced (submitit's own, which
        requeues the job and exits). SIGTERM is never handed on: the run has already stopped cleanly,
        and whoever sent it (Slurm, the sbatch templates) requeues by itself. After a Ctrl-C the process
        exits with status 130 (SystemExit)."""
        if self.submitit is not None and self.submitit in self.received:
            handler: Callable[[int, Any], Any] | int | None = self._previous.get(self.submitit)
            if callable(handler):
                handler(self.submitit, None)
        if signal.SIGINT in self.received:
            raise SystemExit(128 + signal.SIGINT)
