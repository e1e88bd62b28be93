"""Atomic, resumable training checkpoints in the release format (``model`` holds the state dict).

A checkpoint is written atomically (:func:`cat.runtime.io.atomic_save`), so a run killed at any
moment (SIGKILL included) leaves the previous ``last.pth`` intact. Snapshots (``best.pth``,
``epoch_XXXX.pth``) are hard links to the file just written: no extra I/O, and a later rename of
``last.pth`` leaves them untouched. Everything stored loads
with ``torch.load(weights_only=True)``, and resuming reads it through cat's one safe loader.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import torch

from cat.errors import CheckpointError
from cat.models import load_checkpoint_file
from cat.runtime.io import atomic_save, open_owned, refuse_planted, temporary_path
from cat.runtime.schema import absent_defaults

from .schema import ClsModelConfig

__all__ = ["CheckpointManager", "LAST", "recorded_config"]

LAST = "last.pth"  # what a run resumes from


_SNAPSHOT_NAME = re.compile(r"epoch_\d+\.pth")


def epoch_snapshots(folder: str) -> list[str]:
    """The ``epoch_XXXX.pth`` files in ``folder``, oldest first. Names are matched literally in a
    listing of that one folder: a glob character in ``folder`` (``run?``) never reaches other runs."""
    names = sorted(e.name for e in os.scandir(folder) if _SNAPSHOT_NAME.fullmatch(e.name) and e.is_file())
    return [os.path.join(folder, name) for name in names]


def _snapshot(src: str, dst: str) -> None:
    """Atomically make ``dst`` a copy of ``src`` (a hard link where the filesystem allows)."""
    refuse_planted(dst)
    tmp = temporary_path(dst)  # unguessable, and created exclusively: nothing planted there is written through
    try:
        os.link(src, tmp)
    except OSError:
        with open(src, "rb") as source, open(open_owned(tmp, "x"), "wb") as copy:
            shutil.copyfileobj(source, copy)
    os.replace(tmp, dst)


class CheckpointManager:
    """``last.pth`` every save, ``best.pth`` on a new best, and the ``keep_last`` latest ``epoch_XXXX.pth``."""

    def __init__(self, folder: str, keep_last: int = 1) -> None:
        self.folder = folder
        self.keep_last = keep_last
        self.last = os.path.join(folder, LAST)
        self.best = os.path.join(folder, "best.pth")

    def save(self, state: dict[str, Any], is_best: bool = False, epoch_end: bool = True) -> None:
        atomic_save(state, self.last)
        if is_best:
            _snapshot(self.last, self.best)
        if epoch_end and self.keep_last > 0:
            _snapshot(self.last, os.path.join(self.folder, f"epoch_{state['epoch']:04d}.pth"))
            for old in epoch_snapshots(self.folder)[: -self.keep_last]:
                os.unlink(old)

    def load_last(self) -> dict[str, Any] | None:
        """``last.pth`` to resume from (None if there is none); a CheckpointError naming what to do
        when it is unreadable or not a training checkpoint of cat's."""
        if not os.path.lexists(self.last):
            return None
        try:
            if not os.path.isfile(self.last):
                raise CheckpointError(f"{self.last} is not a file")
            saved = load_checkpoint_file(self.last)
            _check_training_checkpoint(saved, self.last)
            return saved
        except CheckpointError as error:
            snapshots = epoch_snapshots(self.folder)
            hint = (
                f"copy a snapshot over it (cp {snapshots[-1]} {self.last})"
                if snapshots
                else "no epoch_*.pth snapshot is left to fall back on"
            )
            raise CheckpointError(
                f"cannot resume: {error}. To go on, {hint}, or start over with resume=false (or another output_dir)"
            ) from None


# What every checkpoint this trainer writes holds (TrainState's entries plus the run's config).
_TRAINING_ENTRIES = ("model", "optimizer", "scheduler", "epoch", "step_in_epoch", "config")
_MAX_CONFIG_DEPTH = 32  # cat's configs are a few levels deep; a deeper one is not one of ours


def _nesting_depth(node: Any) -> int:
    depth, level = 0, [node]
    while level and depth <= _MAX_CONFIG_DEPTH:
        depth += 1
        level = [v for n in level if isinstance(n, (dict, list)) for v in (n.values() if isinstance(n, dict) else n)]
    return depth


def recorded_config(saved: Any) -> dict[str, Any] | None:
    """The run config a checkpoint of this trainer keeps beside its weights (``best.pth``, ``last.pth``,
    snapshots), which names the model they belong to; None for any other file (a release, a bare state
    dict, another trainer's), or one whose config is not a run config of ours."""
    config = saved.get("config") if isinstance(saved, dict) else None
    if not isinstance(config, dict) or _nesting_depth(config) > _MAX_CONFIG_DEPTH:
        return None
    model = config.get("model")
    return config if isinstance(model, dict) and isinstance(model.get("name"), str) else None


def recorded_model_keys(trained: dict[str, Any]) -> dict[str, Any]:
    """The ``model`` section of a recorded run config (:func:`recorded_config`) read through the schema: the keys
    of :class:`ClsModelConfig` that say what the model is (not ``grad_checkpointing``, how it trained), those the run
    predates with the value such runs had (``absent_means``); not yet checked
    (:func:`~cat.classification.checks.recorded_model_config` checks it)."""
    model = trained["model"]
    return {key: model.get(key, default) for key, default in absent_defaults(ClsModelConfig).items()} | {
        "name": model["name"]
    }


def _check_training_checkpoint(saved: Any, path: str) -> None:
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path} holds a {type(saved).__name__}, not a training checkpoint")
    missing = [key for key in _TRAINING_ENTRIES if key not in saved]
    if missing:
        what = "a bare state dict" if all(isinstance(v, torch.Tensor) for v in saved.values()) else "weights only"
        raise CheckpointError(
            f"{path} is {what}, not a training checkpoint (no {', '.join(missing)}); to start from its weights use "
            "checkpoint=PATH in a new output_dir"
        )
    epoch, step = saved["epoch"], saved["step_in_epoch"]  # the last finished epoch (-1: none), the steps since
    if not (type(epoch) is int and type(step) is int and -1 <= epoch < 2**31 and 0 <= step < 2**31):
        raise CheckpointError(
            f"{path}: epoch={epoch!r}, step_in_epoch={step!r}: not the position of a run (the last finished epoch, "
            "from -1, and the steps since, from 0); the file is damaged or not cat's"
        )
    if not isinstance(saved["config"], dict) or _nesting_depth(saved["config"]) > _MAX_CONFIG_DEPTH:
        raise CheckpointError(
            f"{path}: its config is not a run config (not a mapping, or nested over {_MAX_CONFIG_DEPTH} levels)"
        )
