"""Whether a run resumes, and the one rule for what a resumed run may change, which every trainer uses: the
config keys that differ from those its checkpoint was trained with, and the refusal of those the schema
declares FIXED (they would make it another run)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from cat.errors import ConfigError, OutputError

from .job_config import JobConfig
from .ownership import launch_record, made_here, read_started_over, relaunch_of
from .schema import FIXED, RECIPE, config_record, key_rule, run_length_key

__all__ = [
    "resumes",
    "resume_relaunched_start_over",
    "flatten_config",
    "config_changes",
    "Progress",
    "check_resume",
    "describe_changes",
    "START_OVER",
    "file_problem",
    "starting_file_problem",
]

Job = TypeVar("Job", bound=JobConfig)


def resumes(cfg: JobConfig, latest: str) -> bool:
    """Whether a training run goes on from its folder's checkpoint (``latest``: the file there that marks
    one, e.g. ``last.pth``). It then holds the model: ``checkpoint=`` (and a backbone's pretrained weights),
    where the run started, are neither read again nor needed, and may have moved since."""
    return cfg.mode == "train" and bool(cfg.resume) and os.path.lexists(os.path.join(cfg.output_dir, latest))


def resume_relaunched_start_over(cfg: Job) -> tuple[Job, str | None]:
    """A training run with ``resume=false`` that is a later start of the launch that started its folder over (the
    Slurm job requeued, torchrun restarting its workers) goes on with that run: the command is the same, and
    starting over at every requeue would never finish a run longer than the job's time limit. Returns ``cfg`` with
    ``resume=true`` and the line to log; ``cfg`` as it is and None for any other run."""
    if cfg.mode != "train" or cfg.resume or (record := read_started_over(cfg.output_dir)) is None:
        return cfg, None
    now = launch_record()
    if not relaunch_of(record, now):
        return cfg, None
    if now["slurm_restarts"] > record["slurm_restarts"]:
        start = f"Slurm job {now['slurm_job_id']}, now in its restart {now['slurm_restarts']} (requeued)"
    else:
        start = f"torchrun run {now['torchelastic_run_id']}, now in its worker restart {now['torchelastic_restarts']}"
    line = f"resume=false: this folder's run was started over by {start}; it goes on with that run (resume=true)"
    return replace(cfg, resume=True), line


# How a refusal offers to start the folder over (RunDirLock.set_aside_earlier_run).
START_OVER = "resume=false, which starts the folder over and keeps its earlier run in earlier_runs/"


def file_problem(name: str, path: str) -> str | None:
    """What is wrong with ``name=path`` where a file is needed: nothing there, or a folder (a run's folder given
    for its checkpoint: the checkpoints in it are named)."""
    if os.path.isfile(path):
        return None
    if not os.path.isdir(path):
        return f"{name}={path}: no such file"
    held = sorted(entry.name for entry in os.scandir(path) if entry.name.endswith((".pth", ".pt", ".safetensors")))
    return f"{name}={path}: a folder, not a file" + (f" (it holds {', '.join(held[:6])}: give one)" if held else "")


def starting_file_problem(cfg: JobConfig, name: str, path: str) -> str | None:
    """What is wrong with reading the file ``name=path`` a run starts from: not a file (:func:`file_problem`), or,
    in a training run with ``resume=false``, a file its ``output_dir``'s runs made, which the run moves into
    ``earlier_runs/`` before it reads it (a user's own file there stays, and may be read)."""
    if problem := file_problem(name, path):
        return problem
    folder, real = os.path.realpath(cfg.output_dir), os.path.realpath(path)
    if cfg.mode != "train" or cfg.resume or not real.startswith(folder + os.sep):
        return None
    try:
        moved = os.path.relpath(real, folder).split(os.sep)[0] in made_here(folder)
    except (OSError, OutputError):  # a folder that is no run's, or unreadable: refused when the run takes it
        return None
    if moved:
        return (
            f"{name}={path}: made by the run in output_dir, whose files resume=false moves into earlier_runs/ before "
            "the run starts; copy it elsewhere first, or choose another output_dir"
        )
    return None


def flatten_config(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config (plain dicts) as ``{"dotted.key": value}``."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten_config(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, list]:
    """The keys in which two recorded configs differ, ``{dotted key: [saved, current]}``. ``resume`` itself says how
    the run was launched, not what it trains (a requeued ``resume=false`` run goes on with ``true``): left out."""
    old, new = flatten_config(saved), flatten_config(current)
    return {
        k: [old.get(k), new.get(k)] for k in sorted((old.keys() | new.keys()) - {"resume"}) if old.get(k) != new.get(k)
    }


@dataclass(frozen=True)
class Progress:
    """How far a checkpoint's run got, in its run length's unit (:func:`~cat.runtime.schema.run_length_key`):
    ``done`` epochs or iterations finished, and whether the next one had ``begun`` (a mid-epoch checkpoint)."""

    done: int
    begun: bool = False


def check_resume(
    checkpoint: str, saved: dict[str, Any], cfg: JobConfig, progress: Progress | None, refused: Sequence[str] = ()
) -> dict[str, list]:
    """The one resume rule of every trainer, as the schema declares it on the keys (:func:`~cat.runtime.schema.key`):
    the changes from the config ``checkpoint``'s run recorded (``saved``) to the typed config ``cfg``, after
    refusing (ConfigError, every problem on a line) a change of a FIXED key, the trainer's own ``refused`` lines, a
    run length (GROW) below the checkpoint's ``progress`` (the record would claim the shorter run), and RECIPE
    changes for a run with no step left to train them. ``progress`` None (not known): no length is refused."""
    schema, record = type(cfg), config_record(cfg)
    changed = config_changes(saved, record)
    lines = [f"{k}: {changed[k][0]!r} -> {changed[k][1]!r}" for k in changed if key_rule(schema, k) == FIXED]
    problems = [f"cannot resume {checkpoint} with a different {line}" for line in [*lines, *refused]]
    if problems:
        problems.append(f"start a new run in another output_dir, or pass {START_OVER}")
    length_key = run_length_key(schema)
    length = flatten_config(record)[length_key]
    unit = "epochs" if length_key.endswith("epochs") else "iterations"
    if progress is not None and length < progress.done + progress.begun:
        trained = f"begun {unit[:-1]} {progress.done + 1}" if progress.begun else f"trained {progress.done} {unit}"
        problems.append(
            f"{length_key}={length}: {checkpoint} has {trained}; a shorter run needs another output_dir "
            f"(or {START_OVER})"
        )
    recipe = {k: v for k, v in changed.items() if key_rule(schema, k) == RECIPE}
    if progress is not None and recipe and length == progress.done and not progress.begun:
        problems.append(
            f"{checkpoint} has finished its {progress.done} {unit}, so {describe_changes(recipe)} would train "
            "nothing: a run with them needs its own output_dir (or name=), or a longer run to continue this one"
        )
    if problems:
        raise ConfigError(problems)
    return changed


def describe_changes(changed: dict[str, list]) -> str:
    """``key: saved -> current`` for each changed key, on one line, for the log."""
    return "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
