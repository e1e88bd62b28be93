"""A ``torch.profiler`` window over chosen training steps of one process: a trace that Perfetto, Chrome's
``about:tracing`` and TensorBoard's profiler plugin open, and a table of the window's most expensive operators
in the log."""

from __future__ import annotations

import logging
import os

import torch
from torch.profiler import ProfilerActivity, profile

from .io import owned_subfolder, refuse_planted

__all__ = ["PROFILE_DIR", "ProfileWindow"]

PROFILE_DIR = "profile"  # in the run folder: one subfolder per window (a TensorBoard "run")


class ProfileWindow:
    """Records optimizer steps ``first``..``last`` (counted from 1 over the run, as ``metrics.jsonl``'s
    ``step``) into ``<run_folder>/profile/steps_<first>-<last>/rank<rank>.pt.trace.json``: CPU and (on a
    GPU) CUDA activity, input shapes and memory. A window cut short (a stop, the run's end) keeps what it
    recorded."""

    def __init__(
        self, first: int, last: int, run_folder: str, device: torch.device, rank: int, log: logging.Logger, top: int
    ) -> None:
        self.first, self.last, self.device, self.rank, self.log, self.top = first, last, device, rank, log, top
        self.folder = os.path.join(run_folder, PROFILE_DIR, f"steps_{first}-{last}")
        self.profiler: profile | None = None
        self.done = False
        self.recorded_from = self.recorded_to = first  # the steps the window holds, once it opens
        self._own_folders(make=False)  # a file or link there: refused before step 1

    def _own_folders(self, make: bool) -> None:
        """``profile/`` and the window's folder in it: folders cat made (``make``: made where absent), never a
        file or a link out of the run folder (OutputError)."""
        for folder in (os.path.dirname(self.folder), self.folder):
            if make or os.path.lexists(folder):
                owned_subfolder(folder)

    def before_step(self, step: int) -> None:
        """Step ``step`` (1-based over the run) is about to run."""
        if self.profiler is None and not self.done and self.first <= step <= self.last:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.profiler = profile(activities=activities, record_shapes=True, profile_memory=True)
            self.profiler.start()
            self.recorded_from = self.recorded_to = step

    def after_step(self, step: int) -> None:
        self.recorded_to = step
        if self.profiler is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        """End the window where it is and write what it recorded."""
        if self.profiler is None:
            return
        profiler, self.profiler, self.done = self.profiler, None, True
        profiler.stop()
        self._own_folders(make=True)
        path = os.path.join(self.folder, f"rank{self.rank}.pt.trace.json")
        refuse_planted(path)
        profiler.export_chrome_trace(path)
        sort_by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=self.top)
        self.log.info(
            "profile of steps %d-%d (rank %d): %s (Perfetto, chrome://tracing, or tensorboard --logdir %s); "
            "its top %d operators:\n%s",
            self.recorded_from,
            self.recorded_to,
            self.rank,
            path,
            os.path.dirname(self.folder),
            self.top,
            table,
        )
