"""Preemption for mmengine jobs, as classification does it: on a stop signal (SIGTERM, or submitit's;
:mod:`cat.runtime.preemption`) finish the step, save a checkpoint atomically, exit cleanly; the
re-run resumes from that iteration.

mmengine resumes a mid-epoch checkpoint at the right iteration count but replays its epoch from the
first batch; :class:`ResumableEpochBasedTrainLoop` skips the batches that epoch already trained,
through :class:`ResumableDefaultSampler` (indices only, no image is loaded for a skipped batch). Its
iteration loop (segmentation) loads and drops every batch before the resumed iteration instead (up to
160k batches for Table 4's UperNet runs): :class:`ResumableIterBasedTrainLoop`
skips them through :class:`ResumableInfiniteSampler`, the same way.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from mmengine.dataset import DefaultSampler, InfiniteSampler
from mmengine.hooks import Hook
from mmengine.registry import DATA_SAMPLERS, HOOKS, LOOPS
from mmengine.runner import EpochBasedTrainLoop, IterBasedTrainLoop
from torch.utils.data import DataLoader

from cat.runtime.dist import all_reduce_sum
from cat.runtime.io import atomic_write_text
from cat.runtime.preemption import stop_requested, worker_context

from .safe_load import LAST_CHECKPOINT

__all__ = [
    "Preempted",
    "PreemptionHook",
    "ResumableDefaultSampler",
    "ResumableEpochBasedTrainLoop",
    "ResumableInfiniteSampler",
    "ResumableIterBasedTrainLoop",
]


class Preempted(Exception):
    """Raised out of ``runner.train()`` once the preemption checkpoint is saved."""

    def __init__(self, iteration: int, checkpoint: str) -> None:
        self.iteration, self.checkpoint = iteration, checkpoint
        super().__init__(f"stopped at iteration {iteration}; saved {checkpoint}")


@DATA_SAMPLERS.register_module(force=True)
class ResumableDefaultSampler(DefaultSampler):
    """mmengine's DefaultSampler whose next pass can start after ``skip`` of this rank's samples."""

    skip = 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.skip, None)


@LOOPS.register_module(force=True)
class ResumableEpochBasedTrainLoop(EpochBasedTrainLoop):
    """An epoch loop that, resumed mid-epoch, trains only the rest of that epoch."""

    def run_epoch(self) -> None:
        done = self._iter - self._epoch * len(self.dataloader)
        sampler = self.dataloader.batch_sampler.sampler if self.dataloader.batch_sampler is not None else None
        if done <= 0 or not isinstance(sampler, ResumableDefaultSampler):
            return super().run_epoch()
        self.runner.logger.info(
            f"resuming epoch {self._epoch + 1} at iteration {done + 1} of "
            f"{len(self.dataloader)}: skipping the {done} batches it trained"
        )
        sampler.skip = done * self.dataloader.batch_sampler.batch_size
        try:
            self.runner.call_hook("before_train_epoch")
            self.runner.model.train()
            for idx, data_batch in enumerate(self.dataloader, start=done):
                self.run_iter(idx, data_batch)
            self.runner.call_hook("after_train_epoch")
            self._epoch += 1
        finally:
            sampler.skip = 0


@DATA_SAMPLERS.register_module(force=True)
class ResumableInfiniteSampler(InfiniteSampler):
    """mmengine's InfiniteSampler, from ``skip`` of this rank's samples on. Each pass starts the stream from
    the seed again (mmengine's continues one stream across passes), so a pass after a skip sees what the
    uninterrupted run saw there."""

    skip = 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._indices_of_rank(), self.skip, None)


class _TrainedBatches:
    """The loop's data iterator while mmengine's ``run`` advances past the batches a resumed run already
    trained: those draws are None (the sampler already starts after them), then the loader's batches."""

    def __init__(self, batches: Iterator[Any], trained: int) -> None:
        self.batches, self.trained = batches, trained

    def __iter__(self) -> _TrainedBatches:
        return self

    def __next__(self) -> Any:
        if self.trained:
            self.trained -= 1
            return None
        return next(self.batches)


@LOOPS.register_module(force=True)
class ResumableIterBasedTrainLoop(IterBasedTrainLoop):
    """An iteration loop that, resumed at iteration k, loads no image of its first k batches, and whose
    loader's workers start through :func:`~cat.runtime.preemption.worker_context` (mmengine's loop starts
    them as it is built, before any hook could set it, so a stop signal to the whole job killed them)."""

    def __init__(self, runner, dataloader: DataLoader | dict, *args: Any, **kwargs: Any) -> None:
        if isinstance(dataloader, dict):
            context = worker_context(dataloader.get("num_workers", 0))
            dataloader = {**dataloader, "multiprocessing_context": context}
        super().__init__(runner, dataloader, *args, **kwargs)

    def run(self) -> torch.nn.Module:
        sampler = self.dataloader.batch_sampler.sampler if self.dataloader.batch_sampler is not None else None
        if self._iter > 0 and isinstance(sampler, ResumableInfiniteSampler):
            self.runner.logger.info(
                f"resuming at iteration {self._iter + 1}: skipping the {self._iter} batches it trained"
            )
            sampler.skip = self._iter * self.dataloader.batch_sampler.batch_size
            # The loader's first pass (begun as the loop was built) started at 0: a new one starts after the skip.
            self.dataloader_iterator = _TrainedBatches(iter(self.dataloader), self._iter)
            # mmengine's run then warns that it advances the dataloader past them, which it no longer does.
            self.runner.logger.addFilter(_not_advancing)
        try:
            return super().run()
        finally:
            self.runner.logger.removeFilter(_not_advancing)


def _not_advancing(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Advance dataloader ")


@HOOKS.register_module(force=True)
class PreemptionHook(Hook):
    """On a stop signal, after the running iteration (with ``accum_steps``, the accumulation's last): save
    ``iter_N.pth`` (atomically, through the checkpoint hook's backend), point ``last_checkpoint`` at it and raise
    :class:`Preempted`. Every rank takes part in the decision, so they stop together."""

    priority = "LOWEST"

    def __init__(self, backend_args: dict[str, Any] | None = None) -> None:
        self.backend_args = backend_args

    def before_run(self, runner) -> None:
        """The loops built for this run (train and val, or test) start their workers through
        :func:`~cat.runtime.preemption.worker_context`, so a stop signal leaves them serving the trainer."""
        for loop in (runner._train_loop, runner._val_loop, runner._test_loop):
            loader = getattr(loop, "dataloader", None)  # a loop's config dict until it is built
            if isinstance(loader, DataLoader):
                loader.multiprocessing_context = worker_context(loader.num_workers)

    def after_train_iter(self, runner, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        # Only once the optimizer has stepped: the gradients of an unfinished accumulation (accum_steps) are not
        # in a checkpoint, and the resumed run would step without them. Every rank reaches the same iterations.
        if not runner.optim_wrapper.should_update():
            return
        flag = all_reduce_sum(torch.tensor([float(stop_requested())]))
        if flag.item() == 0:
            return
        iteration = runner.iter + 1  # mmengine counts this iteration after the hooks
        name = f"iter_{iteration}.pth"
        runner.save_checkpoint(runner.work_dir, name, by_epoch=False, backend_args=self.backend_args)
        path = os.path.join(runner.work_dir, name)
        if runner.rank == 0:
            atomic_write_text(os.path.join(runner.work_dir, LAST_CHECKPOINT), path)
        raise Preempted(iteration, path)
