"""A Hydra multirun's cells: each cell's own run folder and W&B name, the record a refused cell leaves there,
and the other cells that failed in a launch (Hydra reports only the first)."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import TypeVar

from hydra.conf import SweepDir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from cat.errors import ConfigError, SweepCellError

from .io import atomic_write_text
from .job_config import JobConfig
from .logger import LOG_TIME_FORMAT, last_log_line
from .ownership import check_writable
from .resume import resume_relaunched_start_over
from .schema import schema_problems, typed_config

__all__ = [
    "sweep_of_cell",
    "typed_job_config",
    "cell_dir",
    "command_line_problems",
    "write_overrides",
    "record_refused_cell",
    "other_failed_cells",
]

Job = TypeVar("Job", bound=JobConfig)


def sweep_of_cell() -> SweepDir | None:
    """Hydra's ``sweep`` settings (``dir``, ``subdir``: the cell's overrides) where this runs as a multirun's cell."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return HydraConfig.get().sweep
    return None


def typed_job_config(raw: DictConfig, schema: type[Job]) -> tuple[Job, list[str]]:
    """The composed config, typed before anything reads it: checked against ``schema`` (ConfigError: every problem,
    a line each), then settled where and how the run writes: a sweep cell's own folder (:func:`_in_sweep_cell`) and
    ``resume`` for a relaunch of a run started over (:func:`cat.runtime.resume.resume_relaunched_start_over`).
    Returns it with the lines for the run's log; the task's own checks (paths among them) come after."""
    if problems := schema_problems(raw, schema):
        raise ConfigError(problems)
    cfg, relaunch = resume_relaunched_start_over(_in_sweep_cell(typed_config(raw, schema)))
    return cfg, [relaunch] if relaunch else []


def _in_sweep_cell(cfg: Job) -> Job:
    """In a Hydra multirun, ``cfg`` with ``output_dir`` at the cell's own folder, ``<hydra.sweep.dir>/<the cell's
    overrides>``: cells never share a folder, and relaunching the sweep finds each cell's checkpoints where it left
    them. Its W&B run is named after the cell too, in the sweep's group, so seeds and settings of one sweep are told
    apart there as well. Elsewhere ``cfg`` as it is."""
    if (sweep := sweep_of_cell()) is None:
        return cfg
    wandb = cfg.logger.wandb
    wandb = replace(
        wandb,
        name=f"{wandb.name}/{sweep.subdir}" if sweep.subdir else wandb.name,
        group=cfg.sweep_name if wandb.group is None else wandb.group,
    )
    return replace(cfg, output_dir=cell_dir(sweep), logger=replace(cfg.logger, wandb=wandb))


def cell_dir(sweep: SweepDir) -> str:
    """The cell's folder, ``<hydra.sweep.dir>/<the cell's overrides>``, inside the sweep's folder (a value with
    ``/``, a checkpoint's path, nests it there). A name that would leave it (a ``..`` part) or that holds control
    characters is a ConfigError naming it."""
    name = str(sweep.subdir or "")
    if _leaves_folder(name):
        raise ConfigError(
            f"sweep cell {name!r}: a cell's folder is named by its overrides, and these would put it outside the "
            f"sweep's folder {sweep.dir} ('..' or control characters in a value that names cells); drop them from "
            "the values"
        )
    path = os.path.join(sweep.dir, name)
    if os.path.islink(path.rstrip("/")):
        raise ConfigError(
            f"sweep cell folder {path} is a symbolic link (to {os.readlink(path.rstrip('/'))}): a cell writes only in "
            "a folder of its own; remove the link"
        )
    return path


def _leaves_folder(name: str) -> bool:
    """Whether a relative folder name would leave the folder it is joined to: a '..' part, an absolute path, or
    control characters."""
    return ".." in name.split("/") or name.startswith("/") or not name.isprintable()


_NAME_SEPARATORS = ("hydra.job.config.override_dirname.kv_sep", "hydra.job.config.override_dirname.item_sep")


def _resolved(value: str) -> str | None:
    """``value`` as it resolves where it holds only interpolations that need no config (``${oc.env:X}``); None where
    it cannot be resolved here (one that names the config's keys is checked as the cell's folder, later)."""
    if "${" not in value:
        return value
    try:
        return str(OmegaConf.create({"value": value})["value"])
    except Exception:  # an interpolation of the config's own keys, or one that does not resolve at all
        return None


# More cells than this in one sweep is a typo (a range's step, a missing comma), not a plan: refused before it expands.
MAX_SWEEP_CELLS = 10_000


RANGE_PROBLEM = "a range needs a finite start and stop and a step other than 0"


def range_length(sweep: RangeSweep) -> int | None:
    """How many values Hydra's ``range(start, stop, step)`` stands for, counted without expanding it; None for one
    that never ends or cannot be made (no start or stop, a step of 0, a bound at infinity or NaN)."""
    start, stop, step = sweep.start, sweep.stop, 1 if sweep.step is None else sweep.step
    if start is None or stop is None or step == 0 or not all(math.isfinite(b) for b in (start, stop, step)):
        return None
    return max(0, math.ceil((stop - start) / step))


def command_line_problems(args: Sequence[str], unnamed: Sequence[str], groups: Collection[str] = ()) -> list[str]:
    """What forbids a multirun's command line before Hydra expands it, one line each: a range that never ends (a
    step of 0, a bound at infinity), more than :data:`MAX_SWEEP_CELLS` cells, a key left out of cell names
    (``unnamed``) given several values, whose cells would share a folder, and a value that names cells with a
    ``..`` part or control characters, which would put a cell's folder outside the sweep's (:func:`cell_dir`).
    For any run, a ``hydra.run.dir`` or ``hydra.sweep.dir`` that cannot be written (Hydra makes it before the run
    starts), and a config group (``groups``) set to null, which Hydra refuses with a traceback. What Hydra cannot
    parse is left to Hydra's own refusal."""
    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")])
    except HydraException:
        return []
    except ValueError as error:  # Python reads no integer of more than 4300 digits (sys.get_int_max_str_digits)
        return [f"a value on the command line is not one a config holds: {error}"]
    problems, cells, multirun = [], 1, bool({"-m", "--multirun"} & set(args))
    for override in overrides:
        if override.key_or_group in groups and not override.is_delete() and override.value() is None:
            problems.append(
                f"{override.input_line}: {override.key_or_group} is a config group, whose value names one of its "
                f"options; to run without the group's default, leave it out with '~{override.key_or_group}'"
            )
        # Where a sweep and its cells go, checked before Hydra makes a folder: under outputs/<task>/sweeps/. A value
        # is checked as it resolves (an environment variable's interpolation included).
        if override.key_or_group in ("sweep_name", "hydra.sweep.subdir"):
            named = [_resolved(str(override.value()))] if not override.is_sweep_override() else []
            problems += [
                f"{override.input_line}: {override.key_or_group} names a folder inside the sweeps' folder; "
                f"{v!r} would leave it ('..', an absolute path or control characters)"
                for v in named
                if v is not None and (_leaves_folder(v) or not v.strip())
            ]
        # The separators Hydra joins a cell's overrides with into its folder's name: a '/' would make folders of
        # their own, outside the sweep's with '..', before any cell is refused.
        if override.key_or_group in _NAME_SEPARATORS and not override.is_sweep_override():
            separator = _resolved(str(override.value()))
            if separator is not None and ("/" in separator or not separator.isprintable()):
                problems.append(
                    f"{override.input_line}: joins a sweep cell's overrides into one folder name; {separator!r} "
                    "holds a '/' or control characters, which would make folders of their own"
                )
        if override.key_or_group in ("hydra.run.dir", "hydra.sweep.dir") and not override.is_sweep_override():
            folder = override.get_value_element_as_str()
            if "${" not in folder and (problem := check_writable(folder, override.key_or_group)) is not None:
                problems.append(problem)
        if not multirun:
            continue
        values = [override.get_value_element_as_str()] if not override.is_sweep_override() else []
        sweep = override.value() if override.is_sweep_override() else None
        if isinstance(sweep, IntervalSweep):  # Hydra's basic sweeper, cat's, stops on it with a traceback
            problems.append(
                f"{override.input_line}: interval() is a search space for optimizing sweepers (Optuna, Ax), which "
                "cat's sweeps do not use; give the values (a,b,c) or a range(start,stop,step)"
            )
            continue
        if isinstance(sweep, RangeSweep):
            if (length := range_length(sweep)) is None:
                problems.append(f"{override.input_line}: {RANGE_PROBLEM}")
                continue
            cells *= max(1, length)
        elif isinstance(sweep, ChoiceSweep):
            values = [str(v) for v in sweep.list]
            cells *= max(1, len(values))
        if override.key_or_group.startswith("hydra"):
            continue
        if override.key_or_group in unnamed:
            if sweep is not None:  # its values would share one cell's folder: the second finds the first's run
                problems.append(
                    f"{override.input_line}: {override.key_or_group} does not name a sweep's cells, so its values "
                    "would share one cell's folder; sweep them in separate sweeps (sweep_name=...)"
                )
            continue
        problems += [
            f"{override.input_line}: the value {v!r} names sweep cells, and its '..' or control characters would put "
            "a cell's folder outside the sweep's folder"
            for v in values
            if ".." in v.split("/") or not v.isprintable()
        ]
    if cells > MAX_SWEEP_CELLS:
        problems.append(f"the sweep expands to {cells} cells, over {MAX_SWEEP_CELLS}: check its ranges and lists")
    return problems


def write_overrides(folder: str) -> None:
    overrides = OmegaConf.create(list(HydraConfig.get().overrides.task))
    atomic_write_text(os.path.join(folder, "overrides.yaml"), OmegaConf.to_yaml(overrides))


def record_refused_cell(sweep: SweepDir, message: str) -> None:
    """A sweep cell refused before its run opened its folder (a bad value, a missing file) leaves its one line
    there, in the ``log.txt`` and ``overrides.yaml`` a run writes, so the sweep's table names how it ended rather
    than counting it as never started. A folder that already holds a log (an earlier run of the cell, or one that
    holds it now) keeps it as it is. Every task of the cell writes the same files, atomically."""
    try:
        folder = cell_dir(sweep)
    except ConfigError:  # a folder outside the sweep's: the sweep's report names the cell
        return
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
