"""The classification training loop: resume, then per epoch train, evaluate, checkpoint; a SIGTERM
saves mid-epoch and ends the run cleanly. Each step is a short function over the train state."""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from cat.data import ZipImageDataset, file_format
from cat.errors import CheckpointError
from cat.runtime import (
    DistEnv,
    RunFolder,
    all_reduce_sum,
    capture_rng_state,
    describe_precision,
    restore_rng_state,
    seed_everything,
)
from cat.runtime.io import open_append
from cat.runtime.preemption import stop_requested
from cat.runtime.resume import Progress, check_resume, describe_changes
from cat.runtime.schema import config_record

from .checkpoints import CheckpointManager
from .data_loading import build_train_data
from .loops import EpochProgress, EpochResult, NonFiniteLossError, train_one_epoch
from .meters import build_profile_window, build_step_meter
from .metrics import BEST, EMA, console_text, evaluate, split_names
from .model_building import CompilePlan, attention_plan, build_train_model, compile_plan, compiled, lean_blocks
from .optimization import build_train_options, build_train_state
from .schema import ClsConfig
from .state import TrainState

__all__ = ["fit", "Trainer"]


def _epoch_seed(seed: int, epoch: int, rank: int) -> int:
    # Re-seeding at each epoch start makes an epoch's randomness independent of how the run got there,
    # so a run resumed from an epoch-end checkpoint matches an uninterrupted one.
    return seed * 1_000_003 + epoch * 1009 + rank


@dataclass
class ResumePoint:
    """What a mid-epoch checkpoint adds for this rank: its RNG states and the epoch's totals so far."""

    rng: dict[str, Any] | None = None
    carried: EpochProgress | None = None
    resumed: bool = False
    changed: dict[str, list] | None = None  # config changes since the checkpoint, recorded once they ran


def _weights_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in model.state_dict().values() if t.is_floating_point())


def resume(
    cfg: ClsConfig, env: DistEnv, folder: RunFolder, ckpt: CheckpointManager, state: TrainState, steps_per_epoch: int
) -> ResumePoint:
    """Load ``output_dir/last.pth`` into ``state`` if there is one; refuse config changes that would
    make it another run (:func:`~cat.runtime.resume.check_resume`), and return the others
    (:func:`record_config` writes them down once a checkpoint under them is saved)."""
    saved = ckpt.load_last()
    if saved is None:
        return ResumePoint()
    if saved["step_in_epoch"] >= steps_per_epoch:  # an epoch's end is saved as the next epoch's step 0
        raise CheckpointError(
            f"{ckpt.last}: step_in_epoch={saved['step_in_epoch']} is past this run's {steps_per_epoch} steps per epoch "
            "(another batch size or dataset than the run it resumes): start a new run in another output_dir"
        )
    refused = []
    if saved["step_in_epoch"] and saved.get("world_size", env.world_size) != env.world_size:
        refused.append(f"world size {saved['world_size']} -> {env.world_size} (mid-epoch)")
    trained = Progress(saved["epoch"] + 1, begun=bool(saved["step_in_epoch"]))
    changed = check_resume(ckpt.last, saved.get("config") or {}, cfg, trained, refused)
    state.load_state_dict(saved)
    point = ResumePoint(resumed=True, changed=changed or None)
    rng, progress = saved.get("rng"), saved.get("epoch_progress")
    if state.step_in_epoch and rng is not None and len(rng) == env.world_size:
        point.rng = rng[env.rank]
    if state.step_in_epoch and progress is not None and len(progress) == env.world_size:
        point.carried = EpochProgress(**progress[env.rank])
    folder.log.info(
        "resumed from %s: epoch %d, step %d of %d", ckpt.last, state.epoch + 1, state.step_in_epoch, steps_per_epoch
    )
    if changed:
        folder.log.info("config changed since the checkpoint, applied from here on: %s", describe_changes(changed))
    return point


def record_config(cfg: ClsConfig, folder: RunFolder, changed: dict[str, list] | None, epoch: int, step: int) -> None:
    """``config.yaml`` says what runs now, and ``config_changes.jsonl`` gains the resume's changes
    (from ``epoch``/``step``, 1-based as logged). Called once the changed config has saved a
    checkpoint, so the record never claims a change that did not train."""
    folder.write_config(cfg)
    if changed and folder.is_main:
        entry = {"epoch": epoch, "step_in_epoch": step, "changed": changed, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        with open_append(folder.file("config_changes.jsonl")) as f:
            f.write(json.dumps(entry) + "\n")


class _Checkpoints:
    """Saving for one run: the state plus what every checkpoint of it carries (config, world size)."""

    def __init__(self, cfg: ClsConfig, env: DistEnv, folder: RunFolder) -> None:
        self.manager = CheckpointManager(folder.path, keep_last=cfg.save.keep_last)
        self.folder = folder
        self.config = config_record(cfg)
        self.env = env
        self.has_good = False  # last.pth is this run's: resumed from, or saved since
        self.after_first_save: Callable[[], None] | None = None

    def kept(self) -> str:
        if self.has_good:
            return f"{self.manager.last} (the last good checkpoint) is kept"
        return "this run saved no checkpoint"

    def _saved(self) -> None:
        self.folder.record_made()
        self.has_good = True
        if self.after_first_save is not None:
            self.after_first_save()
            self.after_first_save = None

    def save_epoch_end(self, state: TrainState, is_best: bool) -> None:
        if self.env.is_main:
            self.manager.save(self._entries(state, None, None), is_best=is_best)
        self._saved()

    def save_mid_epoch(self, state: TrainState, progress: EpochProgress) -> None:
        """Every rank's RNG states and epoch totals go in, so each resumes exactly where it stopped."""
        rng: list[Any] = [None] * self.env.world_size
        totals: list[Any] = [None] * self.env.world_size
        if self.env.distributed:
            dist.all_gather_object(rng, capture_rng_state())
            dist.all_gather_object(totals, asdict(progress))
        else:
            rng, totals = [capture_rng_state()], [asdict(progress)]
        if self.env.is_main:
            self.manager.save(self._entries(state, rng, totals), epoch_end=False)
        self._saved()

    def _entries(self, state: TrainState, rng: list | None, progress: list | None) -> dict[str, Any]:
        return {
            **state.state_dict(),
            "config": self.config,
            "rng": rng,
            "epoch_progress": progress,
            "world_size": self.env.world_size,
        }


def _check_finite(state: TrainState, checkpoints: _Checkpoints, val_loss: float | None = None) -> None:
    """Nothing non-finite is ever saved: stop with the epoch named (counted as in the log)."""
    what = None
    if val_loss is not None and not math.isfinite(val_loss):
        what = f"validation loss ({val_loss})"
    elif not _weights_finite(state.model):
        what = "weights"
    if what is not None:
        raise NonFiniteLossError(
            f"epoch {state.epoch + 1} has non-finite {what}; it is not saved and {checkpoints.kept()}"
        )


def _wrap_for_training(plan: CompilePlan, env: DistEnv, model: torch.nn.Module) -> torch.nn.Module:
    """What the loop calls: ``model`` in DDP where several processes train, compiled as ``plan`` says. The DDP module
    is compiled, not wrapped around a compiled one: a compiled backward is one function whose gradients are all ready
    at its end, and only dynamo's DDP optimizer, which sees the DDP module, splits it at the gradient buckets."""
    if not env.distributed:
        return compiled(plan, model)
    ddp = DistributedDataParallel(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
    return compiled(plan, ddp)


def _summary(state: TrainState, **extra: Any) -> dict[str, Any]:
    return {
        **state.metrics,
        f"val/{BEST}": state.best_top1,
        "epoch": state.epoch,
        "wall_time_s": state.wall_time_s,
        **extra,
    }


def fit(cfg: ClsConfig, env: DistEnv, folder: RunFolder) -> dict[str, Any]:
    """Train ``cfg`` into ``folder`` (resuming from its ``last.pth``); returns the run's metrics."""
    return Trainer(cfg, env, folder).fit()


class Trainer:
    """One classification training run: its data, train state, loop options and checkpoints, built
    once, and the epoch loop over them (:meth:`fit`)."""

    def __init__(self, cfg: ClsConfig, env: DistEnv, folder: RunFolder) -> None:
        self.cfg, self.env, self.folder = cfg, env, folder
        # The model before the data where the config gives the class count: weights that do not fit (checkpoint=)
        # are refused before ImageNet's folders are scanned, which takes minutes on a network file system.
        known = cfg.data.num_classes
        model = build_train_model(cfg, env, known) if known is not None else None
        self.data = build_train_data(cfg, env, folder.path)
        self.state = build_train_state(cfg, env, self.data, model)
        # SIGTERM (and submitit's signal) asks the loop to finish its step, save and return.
        self.opts = build_train_options(
            cfg,
            env,
            self.data,
            folder.metrics.log,
            stop_requested,
            meter=build_step_meter(cfg, env, self.state.model),
            profiler=build_profile_window(cfg, env, folder.path, cfg.epochs * self.data.steps_per_epoch),
        )
        self.precision = self.opts.precision
        self.checkpoints = _Checkpoints(cfg, env, folder)
        self.plan = self._compile_plan()
        self.state.stable_grads = self.plan.stable_grads

    def _compile_plan(self) -> CompilePlan:
        """How the model compiles: with ``model.lean_attention=auto`` the blocks that would go lean at this batch are
        found first (a forward on tensors without data), since those run outside the graph."""
        cfg, env = self.cfg, self.env
        plan = compile_plan(cfg, env.device, env.world_size)
        if plan.mode is None or cfg.model.lean_attention != "auto":
            return plan
        batch = (cfg.batch_size, 3, *cfg.input_size())
        return compile_plan(cfg, env.device, env.world_size, lean_blocks(self.state.model, batch, self.precision))

    def fit(self) -> dict[str, Any]:
        try:
            return self._fit()
        finally:
            if self.opts.profiler is not None:  # a window the run's end (or a stop) cut short
                self.opts.profiler.close()

    def _fit(self) -> dict[str, Any]:
        cfg, state, data, checkpoints, log = self.cfg, self.state, self.data, self.checkpoints, self.folder.log
        log.info("%s", describe_precision(cfg.amp, self.env.device))
        log.info("%s", self.plan.line())
        point = self._resume()
        state.train_model = _wrap_for_training(self.plan, self.env, state.model)
        log.info(
            "model %s: %.2fM params; %d train / %d val images, %d classes; global batch %d, lr %.2e, %d steps/epoch",
            cfg.model.name,
            sum(p.numel() for p in state.model.parameters()) / 1e6,
            len(data.train_set),
            len(data.val_set),
            data.num_classes,
            data.global_batch,
            state.optimizer.param_groups[0]["initial_lr"],  # the peak (scaled) lr; "lr" is the schedule's now
            data.steps_per_epoch,
        )
        if (plan := attention_plan(cfg, self.env, state.model)) is not None:
            log.info("%s", plan)
        if cfg.checkpoint and not point.resumed:
            log.info("weights from %s%s", cfg.checkpoint, ", its weight EMA" if cfg.checkpoint_ema else "")
        self._log_cache()
        if state.epoch >= cfg.epochs:
            log.info("%s already holds a finished run of %d epochs", self.folder.path, cfg.epochs)
        while state.epoch < cfg.epochs:
            started = time.perf_counter()
            result = self._train_epoch(point)
            point = ResumePoint()
            if result.interrupted and not self.env.is_main:  # rank 0 says what it saved
                log.warning(
                    "rank %d: stop requested, leaving with every rank at epoch %d step %d/%d",
                    self.env.rank,
                    state.epoch + 1,
                    state.step_in_epoch,
                    data.steps_per_epoch,
                )
            if result.interrupted and state.step_in_epoch < data.steps_per_epoch:
                state.wall_time_s += time.perf_counter() - started
                _check_finite(state, checkpoints)
                checkpoints.save_mid_epoch(state, result.progress)
                log.info(
                    "stop requested (signal): saved epoch %d step %d/%d to %s; rerun the same command to resume",
                    state.epoch + 1,
                    state.step_in_epoch,
                    data.steps_per_epoch,
                    checkpoints.manager.last,
                )
                return _summary(state, preempted=True)
            # A stop on the epoch's last step lets the epoch end normally (evaluated and saved) first.
            self._end_epoch(result, started)
            if result.interrupted:
                log.info(
                    "stop requested (signal) on the last step of epoch %d: saved it to %s; rerun the same "
                    "command to resume",
                    state.epoch,
                    checkpoints.manager.last,
                )
                return _summary(state, preempted=True)
        return _summary(state, epoch=cfg.epochs)

    def _log_cache(self) -> None:
        """A cache's bytes per rank (``part``: each its 1/world share; ``full``: all on each)."""
        train_set, env = self.data.train_set, self.env
        spec = file_format(self.cfg.data)
        if spec is None or not spec.caches or self.cfg.data.cache_mode == "no":
            return
        assert isinstance(train_set, ZipImageDataset)  # what the caching format's reader makes
        held = torch.zeros(env.world_size, dtype=torch.float64)
        held[env.rank] = train_set.cached_bytes()
        all_reduce_sum(held)
        self.folder.log.info(
            "%s cache (%s): %s MB held by ranks 0-%d; the train split's images: %.1f MB",
            self.cfg.data.format,
            train_set.cache_mode,
            ", ".join(f"{b / 1e6:.1f}" for b in held.tolist()),
            env.world_size - 1,
            train_set.image_bytes() / 1e6,
        )

    def _resume(self) -> ResumePoint:
        """Where training starts: ``last.pth`` if resuming, and the config record to write now or
        once the first checkpoint under a changed config is saved."""
        cfg, state, folder, checkpoints = self.cfg, self.state, self.folder, self.checkpoints
        steps = self.data.steps_per_epoch
        point = resume(cfg, self.env, folder, checkpoints.manager, state, steps) if cfg.resume else ResumePoint()
        state.scheduler.step_update(num_updates=state.global_step(steps))
        checkpoints.has_good = point.resumed
        if point.changed:
            checkpoints.after_first_save = functools.partial(
                record_config, cfg, folder, point.changed, state.epoch + 1, state.step_in_epoch
            )
        else:
            record_config(cfg, folder, None, state.epoch + 1, state.step_in_epoch)
        return point

    def _train_epoch(self, point: ResumePoint) -> EpochResult:
        """Train the rest of epoch ``state.epoch``, with its randomness independent of how the run got here."""
        state, data = self.state, self.data
        seed_everything(_epoch_seed(self.cfg.seed, state.epoch, self.env.rank))
        data.sampler.set_epoch(state.epoch, state.step_in_epoch * self.cfg.batch_size * data.accum_steps)
        batches = iter(data.train_loader)
        if state.step_in_epoch and point.rng is not None:
            restore_rng_state(point.rng)  # after creating the iterator, which draws from the RNG
        return train_one_epoch(state, batches, self.env, self.opts, carried=point.carried)

    def _end_epoch(self, result: EpochResult, started: float) -> None:
        """Evaluate, refuse anything non-finite, advance to the next epoch, save, log."""
        state, data, env = self.state, self.data, self.env
        steady: list[float] = []  # each evaluation's time once warm: a compiled model's first compiles its graph
        metrics = evaluate(state.train_model, data.val_loader, env, self.precision, steady)
        del metrics["num_images"]
        _check_finite(state, self.checkpoints, metrics["loss"])
        if state.ema is not None:
            metrics[EMA] = evaluate(state.ema.module, data.val_loader, env, self.precision, steady)["top1"]
        if self.opts.meter is not None:  # the time left counts the evaluations to come at this one's warm time
            self.opts.meter.eval_done(sum(steady))
        is_best = state.best_top1 is None or metrics["top1"] > state.best_top1
        state.best_top1 = metrics["top1"] if is_best else state.best_top1
        state.wall_time_s += time.perf_counter() - started
        # One name per metric (cat.classification.metrics): the checkpoint's summary, metrics.json, metrics.jsonl, W&B.
        state.metrics = {**split_names("train", {"loss": result.loss}), **split_names("val", metrics)}
        state.epoch, state.step_in_epoch = state.epoch + 1, 0
        self.checkpoints.save_epoch_end(state, is_best)
        self.folder.log.info(
            "epoch %d/%d  train loss %.4f  lr %.2e  val %s  best %.2f%s  (%.1f s, %.0f img/s)",
            state.epoch,
            self.cfg.epochs,
            result.loss,
            result.lr,
            console_text(metrics),
            state.best_top1,
            f"  ema top1 {metrics[EMA]:.2f}" if EMA in metrics else "",
            time.perf_counter() - started,
            result.images_per_s,
        )
        train = {"loss": result.loss, "lr": result.lr, "images_per_s": result.images_per_s}
        record = {**split_names("train", train), **split_names("val", {**metrics, BEST: state.best_top1})}
        self.folder.metrics.log({"epoch": state.epoch, **record}, step=state.epoch * data.steps_per_epoch)
