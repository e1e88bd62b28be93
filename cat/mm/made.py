"""The hook that keeps a run folder's record of what the run made current as mmengine writes in it."""

from __future__ import annotations

from typing import Any

from mmengine.hooks import Hook

from cat.runtime.folder import RunFolder

__all__ = ["RecordMade"]


class RecordMade(Hook):
    """After each iteration, epoch and validation (when mmengine's hooks may have saved a checkpoint, a best one, or
    visualisations), adds what appeared in the run folder to its record (:meth:`RunFolder.record_made`), so a run
    killed later still has its checkpoints recorded as its own."""

    priority = "LOWEST"  # after the checkpoint hook's save

    def __init__(self, folder: RunFolder) -> None:
        self.folder = folder

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        self.folder.record_made()

    def after_train_epoch(self, runner: Any) -> None:
        self.folder.record_made()

    def after_val_epoch(self, runner: Any, metrics: dict[str, Any] | None = None) -> None:
        self.folder.record_made()
