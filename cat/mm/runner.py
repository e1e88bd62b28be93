"""A detection or segmentation job: mmengine's Runner as the body of cat's job lifecycle."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from cat.errors import ConfigError
from cat.runtime import DistEnv, RunFolder, run_job, typed_job_config
from cat.runtime.logger import log_formatter
from cat.runtime.resume import Progress, check_resume, describe_changes
from cat.runtime.schema import run_length_key

from .backbone import check_pretrained
from .checks import check_mm_config
from .safe_load import LAST_CHECKPOINT, check_last_checkpoint, check_weights_match, install_safe_checkpoint_io
from .schema import MMConfig
from .task import MMTask

__all__ = ["run_mm"]


def check_resume_config(cfg: MMConfig, folder: RunFolder) -> None:
    """Where mmengine will auto-resume: the config differs from the one the run folder's last checkpoint was trained
    with only where a resume can take it (:func:`~cat.runtime.resume.check_resume`, the rule both trainers follow),
    and the changes are logged. The checkpoint's own record of its config is compared (:class:`RunConfigHook`), or
    for a run saved before checkpoints carried it, the folder's ``config.yaml``. A folder without a checkpoint to
    resume starts over; a checkpoint with neither record resumes uncompared."""
    from mmengine.runner.checkpoint import CheckpointLoader

    pointer = folder.file(LAST_CHECKPOINT)
    if not os.path.isfile(pointer):
        return
    with open(pointer) as f:  # checked by check_last_checkpoint: a checkpoint in this folder
        checkpoint = f.read().strip()
    loaded = CheckpointLoader.load_checkpoint(checkpoint, map_location="cpu")  # cat's safe loader
    saved = loaded.get("config") if isinstance(loaded, dict) else None
    if not isinstance(saved, dict) and (saved := _config_yaml(folder)) is None:
        return
    length_key = run_length_key(type(cfg))  # schedule.epochs or schedule.iters
    changed = check_resume(checkpoint, saved, cfg, _progress(checkpoint, loaded, length_key == "schedule.epochs"))
    if changed:
        folder.log.info("config changed since the checkpoint: %s", describe_changes(changed))
    if length_key in changed:
        folder.log.warning(
            "%s: %r -> %r; the checkpoint's learning-rate schedulers are restored as they were planned, so "
            "the steps added run at the rate where they ended",
            length_key,
            *changed[length_key],
        )


def _config_yaml(folder: RunFolder) -> dict[str, Any] | None:
    """The run folder's ``config.yaml`` as plain data, None where there is none; refused (ConfigError) where it is
    not a config a run wrote. OmegaConf's YAML loader builds plain data only: a tag that would construct an object
    is an error."""
    saved = folder.file("config.yaml")
    if not os.path.isfile(saved):
        return None
    try:
        before: Any = OmegaConf.to_container(OmegaConf.load(saved))
    except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException) as error:
        before = f"{type(error).__name__}: {error}".splitlines()[0]
    if not isinstance(before, dict):
        raise ConfigError(
            f"{saved} is not the config a run wrote ({str(before)[:200]}); delete it to resume without comparing "
            "configs, or start a new run in another output_dir"
        )
    return before


def _progress(checkpoint: str, loaded: Any, by_epoch: bool) -> Progress | None:
    """How far ``checkpoint`` (``loaded``) trained, in epochs or iterations: mmengine's meta holds the epochs
    finished (the one under way, in a mid-epoch save: cat's preemption names it ``iter_N.pth``) and the iterations
    run. None for a file mmengine did not save (its resume will say so)."""
    meta = loaded.get("meta") if isinstance(loaded, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("epoch" if by_epoch else "iter"), int):
        return None
    if not by_epoch:
        return Progress(meta["iter"])
    mid_epoch = re.fullmatch(r"iter_\d+\.pth", os.path.basename(checkpoint)) is not None
    return Progress(meta["epoch"], begun=mid_epoch)


def run_mm(raw: DictConfig, task: MMTask[Any]) -> dict[str, Any]:
    """Train (auto-resuming from ``output_dir``) or evaluate the ``task`` (:data:`~cat.mm.det.DET`,
    :data:`~cat.mm.seg.SEG`) the composed config ``raw`` describes; returns what metrics.json holds.

    Training writes into ``output_dir``, eval into ``output_dir/eval``. On SIGTERM a training run
    saves ``iter_N.pth`` after the running iteration and returns with ``preempted: true``.
    """
    typed, notes = typed_job_config(raw, task.schema)
    cfg = check_mm_config(typed)

    def body(env: DistEnv, folder: RunFolder) -> dict[str, Any]:
        # cat's process group comes first (run_job): mmengine's own init would call torch.cuda.set_device on CPU.
        task.register_modules()  # cat's own components registered as cat.mm was imported (cat.mm.plugin)
        install_safe_checkpoint_io()  # every checkpoint this run reads through cat's safe loader
        from mmengine.runner import Runner

        from .config import RunnerConfig
        from .made import RecordMade
        from .metric_sink import sinks_for_new_backends
        from .preemption import Preempted
        from .registered import component_names, import_custom_modules, type_problems
        from .validation import GatherInRunFolder, LastValidation, test_repeats_validation
        from .writes import write_problems

        mm = task.build_config(cfg, env, folder.path)
        import_custom_modules(mm)
        # Before the runner makes or writes anything, and before a registry is asked for any name (a dotted one
        # would be imported): every type registered, then where each component writes.
        if problems := type_problems(mm) or write_problems(mm, folder.path):
            raise ConfigError(problems)
        folder.log.info("mmengine hooks: %s; visualizer backends: %s", *component_names(mm))
        if mm.resume and mm.load_from is None:  # mmengine's auto-resume follows last_checkpoint
            check_last_checkpoint(folder.path)
            check_resume_config(cfg, folder)
        folder.write_config(cfg)
        # The Runner dumps its config into the run folder (rank 0) under the config's file name, which was the
        # packaged base's (an R50 detector's name beside a CA-PVT run): named for the run instead. Its text in the
        # log and the checkpoints' meta is mmengine's own layout, not re-flowed by yapf (0.3-0.8 s a run); the
        # dumped mm_config.py is laid out by pprint (RunnerConfig.dump).
        mm = RunnerConfig(
            mm.to_dict(), cfg_text=mm.text, filename=folder.file("mm_config.py"), format_python_code=False
        )
        with sinks_for_new_backends(folder.metrics):
            runner = Runner.from_cfg(mm)
        if mm.load_from is not None and cfg.strict_load:  # an evaluation's weights, or those a run starts from
            check_weights_match(runner.model, mm.load_from)
        if cfg.mode == "train":  # the backbone's weights are read at the training's start only
            check_pretrained(runner.model)
        if env.is_main:  # mmengine's log lines in log.txt too, as they happen
            handler = logging.FileHandler(folder.file("log.txt"))
            handler.setFormatter(log_formatter())
            runner.logger.addHandler(handler)
        last_validation = LastValidation()
        runner.register_hook(last_validation)
        runner.register_hook(RecordMade(folder))
        runner.register_hook(GatherInRunFolder(folder.path))
        try:
            if cfg.mode == "train":
                runner.train()
            # An evaluation ran no validation: final() is None there.
            results = last_validation.final(runner) if test_repeats_validation(mm) else None
            if results is None:
                results = runner.test()
            else:
                folder.log.info(
                    "test: the last validation evaluated the final weights on the test loader's data with its "
                    "evaluator; its metrics are the test's (no second pass)"
                )
        except Preempted as stop:
            folder.log.info(
                "stop requested (signal): saved iteration %d to %s; rerun the same command to resume",
                stop.iteration,
                stop.checkpoint,
            )
            return {"mode": cfg.mode, "preempted": True, "iteration": stop.iteration, "checkpoint": stop.checkpoint}
        metrics: dict[str, Any] = {
            key: None if results.get(mm_key) is None else float(results[mm_key])  # numpy -> JSON
            for key, mm_key in task.metrics.items()
        }
        # runner.iter would build the train loop (and its dataset) in an eval run: step 0 there.
        step = runner.iter if cfg.mode == "train" else 0
        folder.metrics.log({f"test/{k}": v for k, v in metrics.items() if v is not None}, step)
        metrics.update({"mode": cfg.mode, "checkpoint": cfg.checkpoint})
        folder.log.info("%s %s: %s", task.name, cfg.mode, {k: v for k, v in metrics.items() if v is not None})
        return metrics

    return run_job(cfg, body, notes)
