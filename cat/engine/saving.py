"""Atomic, resumable training checkpoints in the release format (``model`` holds the state dict).

A checkpoint is written atomically (:func:`cat.runtime.io.atomic_save`), so a run killed at any
moment (SIGKILL included) leaves the previous ``last.pth`` intact. Snapshots (``best.pth``,
``epoch_XXXX.pth``) are hard links to the file just written: no extra I/O, and a later rename of
``last.pth`` leaves them untouched. Everything stored loads
with ``torch.load(weights_only=True)``, and resuming reads it through cat's one safe loader.
"""

from __future__ import annotations

import glob
import os
import shutil
from typing import Any

from cat.errors import CheckpointError
from cat.models import load_checkpoint_file
from cat.runtime.io import atomic_save

__all__ = ["CheckpointManager"]


def _snapshot(src: str, dst: str) -> None:
    """Atomically make ``dst`` a copy of ``src`` (a hard link where the filesystem allows)."""
    tmp = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.{os.getpid()}.tmp")
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


class CheckpointManager:
    """``last.pth`` every save, ``best.pth`` on a new best, and the ``keep_last`` latest ``epoch_XXXX.pth``."""

    def __init__(self, folder: str, keep_last: int = 1) -> None:
        self.folder = folder
        self.keep_last = keep_last
        self.last = os.path.join(folder, "last.pth")
        self.best = os.path.join(folder, "best.pth")

    def save(self, state: dict[str, Any], is_best: bool = False, epoch_end: bool = True) -> None:
        atomic_save(state, self.last)
        if is_best:
            _snapshot(self.last, self.best)
        if epoch_end and self.keep_last > 0:
            _snapshot(self.last, os.path.join(self.folder, f"epoch_{state['epoch']:04d}.pth"))
            for old in sorted(glob.glob(os.path.join(self.folder, "epoch_*.pth")))[: -self.keep_last]:
                os.unlink(old)

    def load_last(self) -> dict[str, Any] | None:
        if not os.path.isfile(self.last):
            return None
        try:
            return load_checkpoint_file(self.last)
        except CheckpointError as error:
            snapshots = sorted(glob.glob(os.path.join(glob.escape(self.folder), "epoch_*.pth")))
            hint = (
                f"copy a snapshot over it (cp {snapshots[-1]} {self.last})"
                if snapshots
                else "no epoch_*.pth snapshot is left to fall back on"
            )
            raise CheckpointError(
                f"cannot resume: {error}. To go on, {hint}, or start over with resume=false (or another output_dir)"
            ) from None
