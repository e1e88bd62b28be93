"""The signals that ask a job to stop cleanly, shared by every trainer.

SIGTERM (Slurm's preemption and requeue, ``scancel``, the sbatch templates) and, under submitit,
its time-limit signal (``SUBMITIT_PREEMPT_SIGNAL``, USR2 by default) only set a flag; the training
loops poll :func:`stop_requested` once a step, save a checkpoint and return. Submitit's own
handler for its signal (checkpoint the job description and requeue it) is called afterwards by
:meth:`StopSignals.hand_back`, once the run's checkpoint and record are written, so a requeued
cell resumes where it stopped instead of from its last epoch.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

__all__ = ["StopSignals", "stop_requested"]

_active: StopSignals | None = None


def stop_requested() -> bool:
    """Whether a stop signal arrived during the running job (False outside a job)."""
    return _active is not None and bool(_active.received)


def _submitit_signal() -> signal.Signals | None:
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return None
    return getattr(signal, f"SIG{os.environ.get('SUBMITIT_PREEMPT_SIGNAL', 'USR2')}", None)


class StopSignals:
    """While active, the stop signals set a flag instead of ending the process."""

    def __init__(self) -> None:
        self.signals = [signal.SIGTERM]
        self.submitit = _submitit_signal()
        if self.submitit is not None and self.submitit not in self.signals:
            self.signals.append(self.submitit)
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def _request(self, signum: int, frame: Any) -> None:
        self.received.append(signum)

    def __enter__(self) -> StopSignals:
        global _active
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._request)
        _active = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        _active = None

    def hand_back(self) -> None:
        """Give submitit's signal, if it came, to the handler it displaced (submitit's own, which
        requeues the job and exits). SIGTERM is never handed on: the run has already stopped cleanly,
        and whoever sent it (Slurm, the sbatch templates) requeues by itself."""
        if self.submitit is not None and self.submitit in self.received:
            handler: Callable[[int, Any], Any] | int | None = self._previous.get(self.submitit)
            if callable(handler):
                handler(self.submitit, None)
