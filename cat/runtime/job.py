"""The lifecycle every cat job shares around its body: distributed start, the run folder, seeding, the body,
``metrics.json``, tear-down, and what the log says when a run ends with an error."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from cat.errors import OutputError, UserError

from .confine import abi_version, confine, refused_write, writable_folders
from .dist import DistEnv, describe_hosts, init_distributed
from .entry import user_error_message
from .folder import RunFolder, open_run_folder
from .io import atomic_write_json
from .job_config import JobConfig
from .logger import FILE_ONLY
from .metric_sinks import build_metric_sinks
from .preemption import Stopped, StopSignals
from .rng import seed_everything
from .schema import config_record, config_yaml

__all__ = ["run_job", "JobBody", "release_compiled", "confine_run", "ConfinedWriteError"]


JobBody = Callable[[DistEnv, RunFolder], dict[str, Any]]


def run_job(cfg: JobConfig, body: JobBody, notes: Sequence[str] = ()) -> dict[str, Any]:
    """The lifecycle of every cat job: start distributed (``cfg.device``), open and lock the run
    folder of ``cfg.mode`` under ``cfg.output_dir`` (its log starts with ``notes``, what was settled
    before the folder was open), seed each rank from ``cfg.seed``, run
    ``body(env, folder)`` with the stop signals caught (:mod:`cat.runtime.preemption`), write what
    it returns to ``metrics.json`` (rank 0), and tear down, whatever happened. A run that stopped
    on a signal (``preempted`` in its metrics) then hands the signal back (submitit requeues the
    cell). The config must already be checked."""
    env = init_distributed(cfg.device, cfg.dist_timeout_s)
    folder = open_run_folder(
        cfg.output_dir, env, cfg.mode, start_over=cfg.mode == "train" and not cfg.resume, notes=notes
    )
    try:
        confine_run(cfg, folder)
        finished = _finished_record(cfg, folder)
    except UserError:
        folder.close()
        raise
    if finished is not None:  # e.g. a relaunched sweep: finished cells stay as they are
        folder.log.info("%s already holds this run, finished with the same config: nothing to do", folder.path)
        folder.close()
        return finished
    folder.write_overrides()
    config = config_record(cfg)
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
                if (refused := refused_write(error)) is not None:
                    error = ConfinedWriteError(refused)
                    _record_failure(folder, env, error, cfg.dist_timeout_s)
                    raise error from None
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
            release_compiled()
    if metrics.get("preempted"):
        signals.hand_back()
    return metrics


class ConfinedWriteError(OutputError):
    """A write the run's confinement refused (:mod:`cat.runtime.confine`): one line, the path and the key."""


def confine_run(cfg: JobConfig, folder: RunFolder) -> None:
    """Confine this rank's writes (and its workers' and children's) with the kernel before anything is built from
    the user's config (``run.confine``): beneath the run folder, or a multirun's sweep folder (its cells run one
    after another in this process, and a confinement only ever narrows), and the folders
    :func:`cat.runtime.confine.writable_folders` names. Without Landlock the log says the writes are checked only."""
    if not cfg.run.confine:
        folder.log.info("run.confine=false: writes are checked by cat's own checks only, not confined by the kernel")
        return
    abi = abi_version()
    if abi < 1:
        folder.log.warning("this kernel has no Landlock: the run's writes are checked, not confined (run.confine)")
        return
    root = _sweep_folder() or folder.path
    try:
        confined = confine(writable_folders(root, cfg.run.may_write, gpu=torch.cuda.is_available()))
    except PermissionError as error:
        raise OutputError(f"{error.strerror}: this run's folder {error.filename} lies outside it") from None
    except OSError as error:
        folder.log.warning("the run's writes are checked, not confined: Landlock failed (%s)", error)
        return
    folder.log.info(
        "writes confined by the kernel (Landlock ABI %d) to %s (run.may_write adds folders)",
        abi,
        ", ".join(confined.folders),
    )


def _sweep_folder() -> str | None:
    """A Hydra multirun's sweep folder (every cell's output_dir lies in it); None for a single run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return os.path.abspath(HydraConfig.get().sweep.dir)


def release_compiled() -> None:
    """What a compiled run leaves in its process, released: dynamo's caches and compiled code, and the CUDA graphs'
    memory pool (torch.compiler.reset), then the allocator's cache. A multirun's next cell (the same process under
    Hydra's basic launcher) then compiles its own model from a clean compiler and starts with the GPU's memory free."""
    torch.compiler.reset()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


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


def _finished_record(cfg: JobConfig, folder: RunFolder) -> dict[str, Any] | None:
    """The metrics of a training run this folder already finished with exactly this config, if any."""
    metrics_path, config_path = folder.file("metrics.json"), folder.file("config.yaml")
    if cfg.mode != "train" or not (os.path.isfile(metrics_path) and os.path.isfile(config_path)):
        return None
    try:  # both are written atomically: what cannot be read was damaged after the run
        with open(config_path, encoding="utf-8") as f:
            same_config = f.read() == config_yaml(cfg)
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
