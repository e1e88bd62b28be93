"""mmengine's scalars into the run's metric sinks: the OpenMMLab trainers log through the same seam
(``output_dir/metrics.jsonl``, W&B) as the classification trainer."""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator
from typing import Any

from mmengine.registry import VISBACKENDS
from mmengine.visualization import BaseVisBackend

from cat.runtime.metrics import MetricSinks

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


@VISBACKENDS.register_module()
class MetricSinkBackend(BaseVisBackend):
    """A vis backend over a run's :class:`~cat.runtime.metrics.MetricSinks`: what mmengine's
    LoggerHook reports (train losses and lr every ``log_interval`` iterations, validation metrics)
    goes to them at its iteration. Images and configs are not metrics; cat records its configs itself."""

    def __init__(self, save_dir: str | None = None) -> None:
        super().__init__(save_dir)
        if _current is None:
            raise RuntimeError("MetricSinkBackend is built inside sinks_for_new_backends(...) only")
        self.sinks = _current

    @property
    def experiment(self) -> MetricSinks:
        return self.sinks

    def _init_env(self) -> None:
        pass

    def add_scalar(self, name: str, value: Any, step: int = 0, **kwargs: Any) -> None:
        self.add_scalars({name: value}, step)

    def add_scalars(self, scalar_dict: dict, step: int = 0, file_path: str | None = None, **kwargs: Any) -> None:
        scalars = {k: float(v) for k, v in scalar_dict.items() if isinstance(v, numbers.Real)}
        if scalars:
            self.sinks.log(scalars, step)
