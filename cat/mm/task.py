"""What makes a detection or a segmentation job: an :class:`MMTask` names its schema, its OpenMMLab registry,
its dataset layout and metrics, and the few steps in which the two differ. :meth:`MMTask.build_config` is the one
way both build their mmengine config; the entry points (``train_det.py``, ``train_seg.py``) pass their task."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from cat.runtime.dist import DistEnv

from .schema import MMConfig

if TYPE_CHECKING:  # importing this module needs none of the OpenMMLab stack (cat.mm.require_stack says what is missing)
    from mmengine.config import Config

__all__ = ["MMTask"]

TaskConfig = TypeVar("TaskConfig", bound=MMConfig)


@dataclass(frozen=True)
class MMTask(Generic[TaskConfig]):
    name: str  # det or seg: the run's log line and its outputs/<name>/ folder
    what: str  # detection or segmentation, for messages
    stack: tuple[str, ...]  # the OpenMMLab packages it needs
    schema: type[TaskConfig]
    register_modules: Callable[[], None]  # the OpenMMLab package's register_all_modules, default scope set
    layout: str  # what data.root holds, for the message when it does not
    loaders: tuple[tuple[str, str], ...]  # (the dataset's split folder, the Runner's dataloader key)
    metrics: dict[str, str]  # metrics.json key <- the evaluator's key
    set_classes: Callable[[Config, tuple[str, ...] | None], None]  # the heads' class count (None: all classes)
    pipelines: Callable[[Config, TaskConfig], None]  # the data section's scales and crops into the pipelines
    dataset: Callable[[Config, str, str, tuple[str, ...] | None], dict[str, Any]]  # (mm, root, split, classes)
    schedule: Callable[[TaskConfig], tuple[dict[str, Any], list[dict[str, Any]]]]  # -> train_cfg, param_scheduler
    finish: Callable[[Config, TaskConfig, str], None]  # the task's last settings (evaluators, test-time augmentation)

    def build_config(self, cfg: TaskConfig, env: DistEnv, output_dir: str) -> Config:
        """The mmengine Runner config of the typed ``cfg``, writing into ``output_dir``."""
        from .config import apply_common, configure_loader, task_base

        mm, classes, root = task_base(cfg, self.layout)
        self.set_classes(mm, classes)
        self.pipelines(mm, cfg)
        for split, loader in self.loaders:
            batch = cfg.batch_size if loader == "train_dataloader" else 1
            configure_loader(mm[loader], batch, cfg.workers, self.dataset(mm, root, split, classes))
        self.finish(mm, cfg, root)
        mm.train_cfg, mm.param_scheduler = self.schedule(cfg)
        return apply_common(mm, cfg, env, output_dir)
