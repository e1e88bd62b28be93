"""What every job shares around its body: one lifecycle (distributed start, run folder, seed, body,
``metrics.json``, tear-down), the run folder and its log, and how user errors end a run."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from cat.errors import UserError

from .dist import DistEnv, barrier, broadcast_object, init_distributed
from .io import atomic_write_json, atomic_write_text
from .logger import setup_logging
from .rng import seed_everything
from .rundir import RunDirLock

__all__ = ["RunFolder", "open_run_folder", "report_user_errors", "run_dir_for", "run_job", "JobBody"]

F = TypeVar("F", bound=Callable[..., Any])


def run_dir_for(output_dir: str, mode: str) -> str:
    """Where a job of ``mode`` writes: training into ``output_dir``, every other mode into its own
    subfolder, so an eval never overwrites a training run's record."""
    return output_dir if mode == "train" else os.path.join(output_dir, mode)


def _debug_requested(args: tuple[Any, ...]) -> bool:
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return True
    return bool(args and isinstance(args[0], DictConfig) and args[0].get("debug", False))


def report_user_errors(main: F) -> F:
    """Decorate an entry point: a :class:`UserError` ends it with ``error: ...`` and exit status 2.

    Tracebacks stay for bugs, and for user errors with ``HYDRA_FULL_ERROR=1`` or ``debug=true``.
    """

    @functools.wraps(main)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return main(*args, **kwargs)
        except UserError as error:
            if _debug_requested(args):
                raise
            message = str(error).strip()
            if "Original Traceback" in message:  # re-raised from a DataLoader worker: keep its own message
                message = message.splitlines()[-1].split(": ", 1)[-1]
            print(f"error: {message}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    return wrapper  # type: ignore[return-value]


@dataclass
class RunFolder:
    """A run's output folder, held by this run (rank 0 holds the lock; every rank has the path)."""

    path: str
    log: logging.Logger
    is_main: bool
    lock: RunDirLock | None = None

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def write_config(self, cfg: DictConfig) -> None:
        """``config.yaml``: the resolved config this run goes on with; ``overrides.yaml``: the
        command-line overrides it was composed with (when launched through Hydra)."""
        if not self.is_main:
            return
        atomic_write_text(self.file("config.yaml"), OmegaConf.to_yaml(cfg, resolve=True))
        if HydraConfig.initialized():
            atomic_write_text(
                self.file("overrides.yaml"), OmegaConf.to_yaml(OmegaConf.create(list(HydraConfig.get().overrides.task)))
            )

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()


def open_run_folder(output_dir: str, env: DistEnv) -> RunFolder:
    """Create and lock ``output_dir`` (rank 0), clean what killed writers left, set up ``log.txt``.

    All ranks get rank 0's absolute path (even if ``output_dir`` interpolates a timestamp) and the
    same error if the folder is held by another run.
    """
    path = broadcast_object(os.path.abspath(output_dir))
    lock, error = None, None
    if env.is_main:
        try:
            lock = RunDirLock(path).acquire()
        except UserError as caught:
            error = caught
    error = broadcast_object(error)
    if error is not None:
        raise error
    barrier()
    log = setup_logging(env.is_main, os.path.join(path, "log.txt"))
    for note in lock.notes if lock is not None else ():
        log.warning(note)
    return RunFolder(path, log, env.is_main, lock)


JobBody = Callable[[DistEnv, RunFolder], dict[str, Any]]


def run_job(cfg: DictConfig, body: JobBody) -> dict[str, Any]:
    """The lifecycle of every cat job: start distributed (``cfg.device``), open and lock the run
    folder of ``cfg.mode`` under ``cfg.output_dir``, seed each rank from ``cfg.seed``, run
    ``body(env, folder)``, write what it returns to ``metrics.json`` (rank 0), and tear down,
    whatever happened. The config must already be checked."""
    env = init_distributed(cfg.device)
    folder = open_run_folder(run_dir_for(cfg.output_dir, cfg.mode), env)
    try:
        seed_everything(cfg.seed + env.rank)
        folder.log.info(
            "%s mode on %s (world size %d), output in %s", cfg.mode, env.device, env.world_size, folder.path
        )
        metrics = body(env, folder)
        if env.is_main:
            atomic_write_json(folder.file("metrics.json"), metrics)
        return metrics
    finally:
        folder.close()
        if dist.is_initialized():
            dist.destroy_process_group()
