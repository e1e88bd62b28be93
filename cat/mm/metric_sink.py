"""mmengine's scalars into the run's metric sinks: the OpenMMLab trainers log through the same seam
(``output_dir/metrics.jsonl``, W&B) as the classification trainer. Built by a stock OpenMMLab tool from a saved
config, the backend writes a ``metrics.jsonl`` of its own into the tool's log folder."""

from __future__ import annotations

import contextlib
import numbers
import os
from collections.abc import Iterator
from typing import Any

from mmengine.registry import VISBACKENDS
from mmengine.visualization import BaseVisBackend

from cat.runtime.metric_sinks import METRICS_HISTORY, JsonlSink, MetricSinks

__all__ = ["MetricSinkBackend", "sinks_for_new_backends"]

_current: MetricSinks | None = None


@contextlib.contextmanager
def sinks_for_new_backends(sinks: MetricSinks) -> Iterator[None]:
    """The sinks a :class:`MetricSinkBackend` built meanwhile (by ``Runner.from_cfg``) logs to: a
    live handle cannot be in the config, which mmengine copies and prints."""
    global _current
    _current = sinks
    try:
        yield
    finally:
        _current = None


@VISBACKENDS.register_module(force=True)
class MetricSinkBackend(BaseVisBackend):
    """A vis backend over a run's :class:`~cat.runtime.metric_sinks.MetricSinks`: what mmengine's
    LoggerHook reports (train losses and lr every ``log_interval`` iterations, validation metrics)
    goes to them at its iteration. Images and configs are not metrics; cat records its configs itself.

    Built outside :func:`sinks_for_new_backends` (a stock ``tools/train.py`` or ``test.py`` running a saved
    config), it logs to ``save_dir/metrics.jsonl``: mmengine's ``<work_dir>/<timestamp>/vis_data``. Like mmengine's
    own backends it may be built without a ``save_dir`` (mmseg's ``browse_dataset.py`` builds the config's
    visualizer only to draw images): a metric logged then is refused, naming what is missing."""

    def __init__(self, save_dir: str | None = None) -> None:
        super().__init__(save_dir)
        self.own_sinks = _current is None  # closed with the backend, not by a cat run
        self._sinks = _current

    @property
    def experiment(self) -> MetricSinks:
        return self.sinks

    @property
    def sinks(self) -> MetricSinks:
        """The run's sinks; outside a run, ``save_dir/metrics.jsonl``, made at the first metric."""
        if self._sinks is None:
            if self._save_dir is None:
                raise ValueError(
                    "MetricSinkBackend has no save_dir to write metrics.jsonl into: outside a cat run, build it "
                    "through mmengine's Visualizer with one (the Runner gives <work_dir>/<timestamp>/vis_data)"
                )
            os.makedirs(self._save_dir, exist_ok=True)
            self._sinks = MetricSinks([JsonlSink(os.path.join(self._save_dir, METRICS_HISTORY))])
        return self._sinks

    def _init_env(self) -> None:
        pass

    def add_scalar(self, name: str, value: Any, step: int = 0, **kwargs: Any) -> None:
        self.add_scalars({name: value}, step)

    def add_scalars(self, scalar_dict: dict, step: int = 0, file_path: str | None = None, **kwargs: Any) -> None:
        scalars = {k: float(v) for k, v in scalar_dict.items() if isinstance(v, numbers.Real)}
        if scalars:  # mmengine calls this on the main process only
            self.sinks.log(scalars, step)

    def close(self) -> None:
        if self.own_sinks and self._sinks is not None:
            self._sinks.finish()
