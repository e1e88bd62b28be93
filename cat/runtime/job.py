"""What every job shares around its body: one lifecycle (distributed start, run folder, seed, body,
``metrics.json``, tear-down), the run folder and its log, and how user errors end a run."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from cat.errors import OutputError, SweepCellError, UserError

from .dist import DistEnv, barrier, broadcast_object, describe_hosts, init_distributed
from .io import atomic_write_json, atomic_write_text
from .logger import FILE_ONLY, LOG_TIME_FORMAT, last_log_line, setup_logging
from .metrics import MetricSinks, build_metric_sinks
from .preemption import Stopped, StopSignals
from .resume import resume_relaunched_start_over
from .rng import seed_everything
from .rundir import RunDirLock
from .schema import schema_of, section_keys, unknown_key_problem

__all__ = [
    "RunFolder",
    "hydra_entry",
    "open_run_folder",
    "report_user_errors",
    "run_dir_for",
    "run_job",
    "JobBody",
    "settle_run_folder",
]

F = TypeVar("F", bound=Callable[..., Any])


def run_dir_for(output_dir: str, mode: str) -> str:
    """Where a job of ``mode`` writes: training into ``output_dir``, every other mode into its own
    subfolder, so an eval never overwrites a training run's record."""
    return output_dir if mode == "train" else os.path.join(output_dir, mode)


def _sweep_of_cell() -> DictConfig | None:
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
    if (sweep := _sweep_of_cell()) is not None:
        wandb = cfg.logger.wandb
        cfg.output_dir = os.path.join(sweep.dir, sweep.subdir)
        wandb.name = f"{wandb.name}/{sweep.subdir}" if sweep.subdir else wandb.name
        wandb.group = cfg.sweep_name if wandb.group is None else wandb.group


# While Hydra composes the config, HYDRA_FULL_ERROR=1 makes it raise its refusals of the command line
# instead of printing them; the user's own value ('' for none) waits here and is put back as the task
# starts, in whichever process runs it (a Slurm job inherits the submitting shell's environment).
_USERS_FULL_ERROR = "CAT_USERS_HYDRA_FULL_ERROR"


def _restore_full_error() -> None:
    users = os.environ.pop(_USERS_FULL_ERROR, None)
    if users:
        os.environ["HYDRA_FULL_ERROR"] = users
    elif users is not None:
        os.environ.pop("HYDRA_FULL_ERROR", None)


@contextlib.contextmanager
def _users_full_error() -> Iterator[None]:
    """The user's HYDRA_FULL_ERROR while a task runs, the entry's again after it: a multirun's in-process cells
    return to the sweep, whose failed cell the entry then reports."""
    at_entry = {name: os.environ.get(name) for name in (_USERS_FULL_ERROR, "HYDRA_FULL_ERROR")}
    _restore_full_error()
    try:
        yield
    finally:
        for name, value in at_entry.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def hydra_entry(config_path: str, schema: str) -> Callable[[Callable[[DictConfig], None]], Callable[[], None]]:
    """``hydra.main`` on ``<config_path>/config.yaml`` for a trainer whose keys ``schema/<schema>``
    declares, with :func:`report_user_errors`. Hydra's own refusals of the command line (a key the
    config lacks, an option its group lacks, an override that does not parse) end it the same way, one
    line ``error: ...`` and exit status 2, instead of Hydra's report over several lines with status 1
    (whose advice for a mistyped key, '+key=value', the schema then refuses)."""

    def decorate(task: Callable[[DictConfig], None]) -> Callable[[], None]:
        reported_task = report_user_errors(task)

        @functools.wraps(task)
        def task_in_users_environment(cfg: DictConfig) -> None:
            with _users_full_error():  # around the report too: it shows a traceback for the user's HYDRA_FULL_ERROR
                reported_task(cfg)

        hydra_main = hydra.main(config_path=config_path, config_name="config", version_base="1.3")(
            task_in_users_environment
        )

        @functools.wraps(task)
        def entry() -> None:
            users = os.environ.get("HYDRA_FULL_ERROR", "")
            os.environ.update({_USERS_FULL_ERROR: users, "HYDRA_FULL_ERROR": "1"})
            started = time.time()
            try:
                hydra_main()
            except (ConfigCompositionException, OverrideParseException, SweepCellError) as error:
                if users == "1":
                    raise
                if isinstance(error, SweepCellError):  # Hydra raises the first failed cell's error: the others first
                    problems = [*_other_failed_cells(error, started), str(error)]
                else:
                    problems = [_command_line_problem(error, schema_of(schema))]
                for problem in problems:
                    print(f"error: {problem}", file=sys.stderr, flush=True)
                raise SystemExit(2) from None
            finally:
                _restore_full_error()

        return entry

    return decorate


def _other_failed_cells(error: SweepCellError, since: float) -> list[str]:
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


def _command_line_problem(error: ConfigCompositionException | OverrideParseException, schema: type) -> str:
    """Hydra's refusal of an override as one line, in the schema's words where it is about a key."""
    if isinstance(error, OverrideParseException):
        return f"{error.override}: not an override Hydra can parse ({error.message.splitlines()[0]})"
    if isinstance(error, MissingConfigException) and error.options is not None and error.missing_cfg_file:
        group, _, option = error.missing_cfg_file.rpartition("/")
        return f"{group}={option}: no such option (available: {', '.join(error.options)})"
    cause = error.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        parent = cause.full_key.rpartition(".")[0]
        known = section_keys(schema, parent)
        if known:
            return unknown_key_problem(cause.full_key, known)
        if known is None:  # a free-form mapping (model.kwargs) takes new entries with '+', as Hydra says
            addition = str(error).splitlines()[-1].rpartition(" use ")[2]
            return f"{cause.full_key}: {parent} has no such entry; to add one: {addition}"
        return f"{cause.full_key}: {parent} is a single value, not a section of keys"
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def _debug_requested(args: tuple[Any, ...]) -> bool:
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return True
    return bool(args and isinstance(args[0], DictConfig) and args[0].get("debug", False))


def user_error_message(error: UserError) -> str:
    """A user error's message, as its one line ``error: ...`` says it."""
    message = str(error).strip()
    if "Original Traceback" in message:  # re-raised from a DataLoader worker: keep its own message
        message = message.splitlines()[-1].split(": ", 1)[-1]
    return message


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
            message = user_error_message(error)
            print(f"error: {message}", file=sys.stderr, flush=True)
            if (sweep := _sweep_of_cell()) is not None:  # the sweep's other cells still run; it reports this one
                _record_refused_cell(sweep, message)
                raise SweepCellError(
                    f"sweep cell {sweep.subdir or sweep.dir}: {message}", sweep.dir, sweep.subdir
                ) from None
            raise SystemExit(2) from None

    return wrapper  # type: ignore[return-value]


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

    def write_config(self, cfg: DictConfig) -> None:
        """``config.yaml``: the resolved config this run goes on with."""
        if self.is_main:
            atomic_write_text(self.file("config.yaml"), OmegaConf.to_yaml(cfg, resolve=True))

    def write_overrides(self) -> None:
        """``overrides.yaml``: the command-line overrides the run was composed with (launched
        through Hydra), from its start, so a sweep's cells can be told apart while they run."""
        if self.is_main and HydraConfig.initialized():
            _write_overrides(self.path)

    def close(self) -> None:
        try:
            self.metrics.finish()
        finally:
            if self.lock is not None:
                self.lock.release()


def _write_overrides(folder: str) -> None:
    overrides = OmegaConf.create(list(HydraConfig.get().overrides.task))
    atomic_write_text(os.path.join(folder, "overrides.yaml"), OmegaConf.to_yaml(overrides))


def _record_refused_cell(sweep: DictConfig, message: str) -> None:
    """A sweep cell refused before its run opened its folder (a bad value, a missing file) leaves its one line
    there, in the ``log.txt`` and ``overrides.yaml`` a run writes, so the sweep's table names how it ended rather
    than counting it as never started. A folder that already holds a log (an earlier run of the cell, or one that
    holds it now) keeps it as it is. Every task of the cell writes the same files, atomically."""
    folder = os.path.join(sweep.dir, sweep.subdir)
    if os.path.lexists(os.path.join(folder, "log.txt")):
        return
    with contextlib.suppress(OSError):  # an output folder that cannot be written is what the line may say
        os.makedirs(folder, exist_ok=True)
        _write_overrides(folder)
        atomic_write_text(os.path.join(folder, "log.txt"), f"[{time.strftime(LOG_TIME_FORMAT)}] error: {message}\n")


def open_run_folder(output_dir: str, env: DistEnv, start_over: bool = False, notes: Sequence[str] = ()) -> RunFolder:
    """Create and lock ``output_dir`` (rank 0), clean what killed writers left, set up ``log.txt`` and log
    ``notes`` in it; ``start_over`` (a training run with ``resume=false``) first moves an earlier run's files
    into ``earlier_runs/<time>/``.

    All ranks get rank 0's absolute path (even if ``output_dir`` interpolates a timestamp) and the
    same error if the folder is held by another run.
    """
    path = broadcast_object(os.path.abspath(output_dir))
    lock, error = None, None
    if env.is_main:
        try:
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
    return RunFolder(path, log, env.is_main, lock)


JobBody = Callable[[DistEnv, RunFolder], dict[str, Any]]


def run_job(cfg: DictConfig, body: JobBody, notes: Sequence[str] = ()) -> dict[str, Any]:
    """The lifecycle of every cat job: start distributed (``cfg.device``), open and lock the run
    folder of ``cfg.mode`` under ``cfg.output_dir`` (its log starts with ``notes``, what was settled
    before the folder was open), seed each rank from ``cfg.seed``, run
    ``body(env, folder)`` with the stop signals caught (:mod:`cat.runtime.preemption`), write what
    it returns to ``metrics.json`` (rank 0), and tear down, whatever happened. A run that stopped
    on a signal (``preempted`` in its metrics) then hands the signal back (submitit requeues the
    cell). The config must already be checked."""
    env = init_distributed(cfg.device, cfg.dist_timeout_s)
    folder = open_run_folder(
        run_dir_for(cfg.output_dir, cfg.mode), env, start_over=cfg.mode == "train" and not cfg.resume, notes=notes
    )
    try:
        finished = _finished_record(cfg, folder)
    except UserError:
        folder.close()
        raise
    if finished is not None:  # e.g. a relaunched sweep: finished cells stay as they are
        folder.log.info("%s already holds this run, finished with the same config: nothing to do", folder.path)
        folder.close()
        return finished
    folder.write_overrides()
    config = OmegaConf.to_container(cfg, resolve=True)
    folder.metrics = build_metric_sinks(cfg.logger, folder.path, config, env.is_main, cfg.mode == "train")
    with StopSignals(save=cfg.mode == "train") as signals:
        try:
            seed_everything(cfg.seed + env.rank)
            folder.log.info(
                "%s mode on %s (world size %d: %s), output in %s",
                cfg.mode,
                env.device,
                env.world_size,
                describe_hosts(env),
                folder.path,
            )
            try:
                metrics = body(env, folder)
            except Stopped:
                raise
            except Exception as error:
                _record_failure(folder, env, error, cfg.dist_timeout_s)
                raise
            if env.is_main:
                atomic_write_json(folder.file("metrics.json"), metrics)
        except Stopped as stop:
            folder.log.info("%s: nothing to save in %s mode; the run ends here", stop, cfg.mode)
            raise SystemExit(128 + stop.signum) from None
        finally:
            folder.close()
            if dist.is_initialized():
                dist.destroy_process_group()
    if metrics.get("preempted"):
        signals.hand_back()
    return metrics


def _collective_failure(error: RuntimeError) -> bool:
    """Whether ``error`` is a collective that failed: a peer's connection closed, or it timed out."""
    return isinstance(error, dist.DistError) or any(
        mark in str(error) for mark in ("gloo/transport", "ProcessGroupGloo", "NCCL", "Timed out waiting")
    )


def _record_failure(folder: RunFolder, env: DistEnv, error: Exception, timeout_s: int) -> None:
    """The run's log says why it ended: ``log.txt`` is the run's record, and on Slurm the console's error
    stream is another file. A collective that failed means another rank is gone (its node lost, or it
    crashed: its own log says which), and the last complete checkpoint is where to resume from."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if env.distributed and isinstance(error, RuntimeError) and _collective_failure(error):
        folder.log.error(
            "rank %d of %d: a collective failed, another rank stopped answering (a node lost, or that rank failed; "
            "dist_timeout_s=%s): %s. Checkpoints written before it are complete: rerun the same command to resume.",
            env.rank,
            env.world_size,
            timeout_s,
            first_line[:300],
        )
    elif isinstance(error, UserError):  # the console gets its line from report_user_errors
        folder.log.error("error: %s", user_error_message(error), extra=FILE_ONLY)
    else:  # the console gets the traceback
        folder.log.error("the run ended with %s: %s", type(error).__name__, first_line[:300], extra=FILE_ONLY)


def _finished_record(cfg: DictConfig, folder: RunFolder) -> dict[str, Any] | None:
    """The metrics of a training run this folder already finished with exactly this config, if any."""
    metrics_path, config_path = folder.file("metrics.json"), folder.file("config.yaml")
    if cfg.mode != "train" or not (os.path.isfile(metrics_path) and os.path.isfile(config_path)):
        return None
    try:  # both are written atomically: what cannot be read was damaged after the run
        with open(config_path, encoding="utf-8") as f:
            same_config = f.read() == OmegaConf.to_yaml(cfg, resolve=True)
        with open(metrics_path, encoding="utf-8") as f:
            metrics = json.load(f)
        if not isinstance(metrics, dict):
            raise ValueError(f"a JSON {type(metrics).__name__}, not an object")
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise OutputError(
            f"{folder.path} holds a damaged run record ({type(error).__name__}: {str(error)[:120]}); move the folder "
            "aside or choose another output_dir"
        ) from None
    return metrics if same_config and not metrics.get("preempted") else None
