"""A training run's final test without a second pass over the same data: mmengine validates after the last
iteration (or epoch) of every run, and where the test loader and evaluator are the validation's (toy sets, ADE20K
and COCO as cat configures them, test-time augmentation off), the test would evaluate the same weights on the
same images again (minutes on full ADE20K or COCO val). The validation's metrics are the test's then."""

from __future__ import annotations

import os
from typing import Any

from mmengine.config import Config
from mmengine.hooks import Hook

__all__ = ["GatherInRunFolder", "LastValidation", "test_repeats_validation"]


class LastValidation(Hook):
    """Records the metrics of the run's latest validation and the iteration it followed."""

    priority = "LOWEST"

    def __init__(self) -> None:
        self.iteration: int | None = None
        self.metrics: dict[str, Any] | None = None

    def after_val_epoch(self, runner: Any, metrics: dict[str, Any] | None = None) -> None:
        self.iteration, self.metrics = runner.iter, metrics

    def final(self, runner: Any) -> dict[str, Any] | None:
        """The metrics of a validation of the weights training ended with, if this process ran one."""
        return self.metrics if self.iteration == runner.iter and self.metrics is not None else None


def test_repeats_validation(mm: Config) -> bool:
    """Whether ``mm``'s test would read the validation's data the validation's way and score it the same."""
    return mm.test_dataloader == mm.val_dataloader and mm.test_evaluator == mm.val_evaluator


class GatherInRunFolder(Hook):
    """Where the ranks gather a metric's results on the CPU: mmengine writes each rank's part into ``collect_dir``
    and deletes that folder, by default a new one under ``.dist_test/`` in the working directory (left behind
    there, and outside a confined run's reach). A metric given no ``collect_dir`` gathers in the run folder's
    ``.dist_test/`` instead (each evaluation's parts removed before the next begins: rank 0 deletes them before
    it broadcasts the metrics every rank waits for)."""

    priority = "VERY_HIGH"

    def __init__(self, run_folder: str) -> None:
        self.collect_dir = os.path.join(run_folder, ".dist_test")

    def before_val(self, runner: Any) -> None:
        self._place(runner.val_loop)

    def before_test(self, runner: Any) -> None:
        self._place(runner.test_loop)

    def _place(self, loop: Any) -> None:
        for metric in getattr(getattr(loop, "evaluator", None), "metrics", ()):
            if getattr(metric, "collect_device", None) == "cpu" and getattr(metric, "collect_dir", "") is None:
                metric.collect_dir = self.collect_dir
