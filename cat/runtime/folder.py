"""A run's output folder: created and locked by rank 0 (an earlier run set aside when the run starts over), its
log, and the record it holds (``config.yaml``, ``overrides.yaml``, metric sinks)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from hydra.core.hydra_config import HydraConfig

from cat.errors import OutputError, UserError

from .cells import write_overrides
from .dist import DistEnv, barrier, broadcast_object
from .io import atomic_write_text, owned_subfolder
from .job_config import JobConfig
from .logger import setup_logging
from .metric_sinks import MetricSinks
from .ownership import RunDirLock, run_folder_problem
from .schema import config_yaml

__all__ = ["RunFolder", "open_run_folder", "run_dir_for"]


def run_dir_for(output_dir: str, mode: str) -> str:
    """Where a job of ``mode`` writes: training into ``output_dir``, every other mode into its own
    subfolder, so an eval never overwrites a training run's record."""
    return output_dir if mode == "train" else os.path.join(output_dir, mode)


@dataclass
class RunFolder:
    """A run's output folder, held by this run (rank 0 holds the lock; every rank has the path)."""

    path: str
    log: logging.Logger
    is_main: bool
    lock: RunDirLock | None = None
    metrics: MetricSinks = field(default_factory=MetricSinks)  # metrics.jsonl (+ W&B), set by run_job

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def record_made(self) -> None:
        """Record what this run has made in its folder so far (:meth:`RunDirLock.record_made`; rank 0)."""
        if self.lock is not None:
            self.lock.record_made()

    def write_config(self, cfg: JobConfig) -> None:
        """``config.yaml``: the (typed) config this run goes on with."""
        if self.is_main:
            atomic_write_text(self.file("config.yaml"), config_yaml(cfg))
            self.record_made()

    def write_overrides(self) -> None:
        """``overrides.yaml``: the command-line overrides the run was composed with (launched
        through Hydra), from its start, so a sweep's cells can be told apart while they run."""
        if self.is_main and HydraConfig.initialized():
            write_overrides(self.path)
            self.record_made()

    def close(self) -> None:
        try:
            self.metrics.finish()
        finally:
            if self.lock is not None:
                self.lock.release()


def open_run_folder(
    output_dir: str, env: DistEnv, mode: str = "train", start_over: bool = False, notes: Sequence[str] = ()
) -> RunFolder:
    """Create (or take: new, empty or a cat run's) and lock the folder a run of ``mode`` writes in
    (:func:`run_dir_for`; rank 0), clean what killed writers left, set up ``log.txt`` and log ``notes`` in it;
    ``start_over`` (a training run with ``resume=false``) first moves an earlier run's files into
    ``earlier_runs/<time>/``.

    All ranks get rank 0's absolute path (even if ``output_dir`` interpolates a timestamp) and the
    same error if the folder is held by another run, or is not a run's to take.
    """
    path = broadcast_object(os.path.abspath(run_dir_for(output_dir, mode)))
    lock, error = None, None
    if env.is_main:
        try:
            if mode != "train":  # eval/ in a run folder: the run folder's own, a folder, never a link out of it
                if (problem := run_folder_problem(output_dir)) is not None:
                    raise OutputError(problem)
                os.makedirs(output_dir, exist_ok=True)
                owned_subfolder(path)
            lock = RunDirLock(path).acquire()
            if start_over and (kept := lock.set_aside_earlier_run()) is not None:
                lock.notes.append(
                    f"resume=false: this run starts the folder over; the earlier run's files are in {kept}"
                )
        except UserError as caught:
            error = caught
        except OSError as caught:  # the earlier run's files could not be moved aside: they stay where they are
            if lock is not None:
                lock.release()
            error = OutputError(f"resume=false could not move the earlier run's files in {path} aside ({caught})")
    error = broadcast_object(error)
    if error is not None:
        raise error
    barrier()
    log = setup_logging(env.is_main, os.path.join(path, "log.txt"))
    for note in [*notes, *lock.notes] if lock is not None else ():  # rank 0's log
        log.warning(note)
    folder = RunFolder(path, log, env.is_main, lock)
    folder.record_made()  # log.txt
    return folder
