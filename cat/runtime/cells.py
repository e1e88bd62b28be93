"""A Hydra multirun's cells: each cell's own run folder and W&B name, the record a refused cell leaves there,
and the other cells that failed in a launch (Hydra reports only the first)."""

from __future__ import annotations

import contextlib
import os
import time

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from cat.errors import SweepCellError

from .io import atomic_write_text
from .logger import LOG_TIME_FORMAT, last_log_line
from .resume import resume_relaunched_start_over

__all__ = ["sweep_of_cell", "settle_run_folder", "write_overrides", "record_refused_cell", "other_failed_cells"]


def sweep_of_cell() -> DictConfig | None:
    """Hydra's ``sweep`` settings (``dir``, ``subdir``: the cell's overrides) where this runs as a multirun's cell."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return HydraConfig.get().sweep
    return None


def settle_run_folder(cfg: DictConfig) -> list[str]:
    """Where and how a run writes, settled before its config is checked: a sweep cell's own folder
    (:func:`_use_sweep_cell_dir`), and ``resume`` for a relaunch of a run started over
    (:func:`cat.runtime.resume.resume_relaunched_start_over`). Returns the lines for the run's log."""
    _use_sweep_cell_dir(cfg)
    relaunch = resume_relaunched_start_over(cfg)
    return [relaunch] if relaunch else []


def _use_sweep_cell_dir(cfg: DictConfig) -> None:
    """In a Hydra multirun, point ``cfg.output_dir`` at the cell's own folder,
    ``<hydra.sweep.dir>/<the cell's overrides>``: cells never share a folder, and relaunching the
    sweep finds each cell's checkpoints where it left them. Its W&B run is named after the cell too, in
    the sweep's group, so seeds and settings of one sweep are told apart there as well."""
    if (sweep := sweep_of_cell()) is not None:
        wandb = cfg.logger.wandb
        cfg.output_dir = os.path.join(sweep.dir, sweep.subdir)
        wandb.name = f"{wandb.name}/{sweep.subdir}" if sweep.subdir else wandb.name
        wandb.group = cfg.sweep_name if wandb.group is None else wandb.group


def write_overrides(folder: str) -> None:
    overrides = OmegaConf.create(list(HydraConfig.get().overrides.task))
    atomic_write_text(os.path.join(folder, "overrides.yaml"), OmegaConf.to_yaml(overrides))


def record_refused_cell(sweep: DictConfig, message: str) -> None:
    """A sweep cell refused before its run opened its folder (a bad value, a missing file) leaves its one line
    there, in the ``log.txt`` and ``overrides.yaml`` a run writes, so the sweep's table names how it ended rather
    than counting it as never started. A folder that already holds a log (an earlier run of the cell, or one that
    holds it now) keeps it as it is. Every task of the cell writes the same files, atomically."""
    folder = os.path.join(sweep.dir, sweep.subdir)
    if os.path.lexists(os.path.join(folder, "log.txt")):
        return
    with contextlib.suppress(OSError):  # an output folder that cannot be written is what the line may say
        os.makedirs(folder, exist_ok=True)
        write_overrides(folder)
        atomic_write_text(os.path.join(folder, "log.txt"), f"[{time.strftime(LOG_TIME_FORMAT)}] error: {message}\n")


def other_failed_cells(error: SweepCellError, since: float) -> list[str]:
    """The other cells of ``error``'s sweep that ended with a user error in this launch (their log, written
    since ``since``, ends with it), each as its line; Hydra reports only the first failed cell."""
    if error.sweep_dir is None or not os.path.isdir(error.sweep_dir):
        return []
    failed = []
    for cell in sorted(os.listdir(error.sweep_dir)):
        log = os.path.join(error.sweep_dir, cell, "log.txt")
        with contextlib.suppress(OSError):  # not a cell's folder, or no log (yet)
            # since - 5: a shared filesystem's clock may lag this host's
            if cell != error.cell and os.path.isfile(log) and os.path.getmtime(log) >= since - 5:
                line = last_log_line(log) or ""
                if line.startswith("error: "):
                    failed.append(f"sweep cell {cell}: {line.removeprefix('error: ')}")
    return failed
