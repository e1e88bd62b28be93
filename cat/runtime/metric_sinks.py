"""Where a run's metrics go: a :class:`MetricSink` seam that all three trainers log through.

Every run writes ``output_dir/metrics.jsonl`` (one JSON object per log call: ``step``, the metrics
and ``logged_at``, Unix seconds), the machine-readable history ``tools/make_tables.py`` and any plot read, so no curve
exists only inside W&B. W&B is a second sink when ``logger.wandb.mode`` is not ``disabled``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, TextIO

from .io import open_append
from .job_config import LoggerConfig, WandbConfig
from .logger import METRICS_LOGGER, persistent_run_id, resolve_wandb_mode

__all__ = [
    "METRICS_HISTORY",
    "MetricSink",
    "JsonlSink",
    "WandbSink",
    "MetricSinks",
    "build_metric_sinks",
    "read_history",
]

METRICS_HISTORY = "metrics.jsonl"


class MetricSink(Protocol):
    """Somewhere a run's scalar metrics go (rank 0 only)."""

    def log(self, metrics: Mapping[str, float | None], step: int) -> None: ...

    def finish(self) -> None: ...


class JsonlSink:
    """Appends one line per :meth:`log` to a JSON-lines file and flushes it, so a killed run keeps
    every line it logged. The file is opened at the first line: a run refused before it logs
    anything leaves none. A resumed run appends after its earlier lines; where it replays steps,
    :func:`read_history` keeps the later entry."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: TextIO | None = None

    def log(self, metrics: Mapping[str, float | None], step: int) -> None:
        if self._file is None:
            self._file = open_append(self.path)  # open for the run, closed by finish
        # strict JSON: "nan", "inf"; None (not known, e.g. mfu on a CPU) is null
        values = {k: (v if v is None or math.isfinite(v) else str(v)) for k, v in metrics.items()}
        entry = {"step": step, **values}
        entry.update(step=step, logged_at=round(time.time(), 3))  # ours win a name clash (mmengine logs "time")
        self._file.write(json.dumps(entry) + "\n")
        self._file.flush()

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class WandbSink:
    """A W&B run in ``output_dir/wandb`` that resumes with the training run (its id is kept there),
    started at the first :meth:`log`, so a run that fails before it leaves no empty W&B run.

    Once started, a W&B failure ends only W&B's part of the run, with one warning: Slurm sends a
    step's stop signal to every process of the step, so W&B's service process ends while the trainer
    finishes its step and saves, and every later call into W&B raises. The run's own record
    (``metrics.jsonl``, the checkpoints) is complete either way, and the next run resumes the W&B run."""

    def __init__(self, wandb_cfg: WandbConfig, output_dir: str, config: dict[str, Any]) -> None:
        self.settings: dict[str, Any] = {
            "mode": resolve_wandb_mode(wandb_cfg.mode),
            "project": wandb_cfg.project,
            "entity": wandb_cfg.entity,
            "name": wandb_cfg.name,
            "group": wandb_cfg.group,
            "tags": list(wandb_cfg.tags),
            "config": config,
            "dir": output_dir,
            "resume": "allow",
        }
        self.auto = wandb_cfg.mode == "auto"  # the mode resolved here, not asked for by the user
        self.run: Any = None
        self.stopped = False  # W&B failed during this run: nothing more goes to it

    def log(self, metrics: Mapping[str, float | None], step: int) -> None:
        if self.stopped:
            return
        if self.run is None:
            run_id = persistent_run_id(self.settings["dir"])  # a foreign id file is the user's to fix: raised
            try:
                self.run = self._start(run_id)
            except Exception as error:  # any W&B failure: the run's own record goes on
                return self._stop(error, step, started=False)
        try:  # an unknown value (None) is left out: W&B plots no gap for it
            self.run.log({k: v for k, v in metrics.items() if v is not None}, step=step)
        except Exception as error:
            self._stop(error, step, started=True)

    def _start(self, run_id: str) -> Any:
        """The W&B run. Online, a W&B that cannot reach its server (a compute node without internet, where
        ``auto`` found the key of a shared home) or refuses the run gives up after its init timeout; the run then
        goes on offline, with one warning, rather than ending at its first logged step."""
        import wandb

        if self.auto and self.settings["mode"] == "online" and self._logged_offline(run_id):
            self.settings["mode"] = "offline"
            logging.getLogger(METRICS_LOGGER).warning(
                "W&B: this run has logged offline before (an earlier start of it could not reach W&B's server, or "
                "ran offline), so it goes on offline into %s without waiting for the server, for one `wandb sync` "
                "later (logger.wandb.mode=online tries the server)",
                os.path.join(self.settings["dir"], "wandb"),
            )
        try:
            return wandb.init(id=run_id, **self.settings)
        except Exception as error:
            if self.settings["mode"] != "online":
                raise
            with contextlib.suppress(Exception):  # W&B's service still holds the failed run's id
                wandb.teardown()
            self.settings["mode"] = "offline"
            logging.getLogger(METRICS_LOGGER).warning(
                "W&B could not start the run online (%s: %s); it logs offline into %s instead, for `wandb sync` "
                "to upload later (logger.wandb.mode=offline skips the attempt, which waits WANDB_INIT_TIMEOUT "
                "seconds, 90 by default)",
                type(error).__name__,
                " ".join(str(error).split()),
                os.path.join(self.settings["dir"], "wandb"),
            )
            return wandb.init(id=run_id, **self.settings)

    def _logged_offline(self, run_id: str) -> bool:
        """Whether W&B keeps an offline run of ``run_id`` in the run folder (``wandb/offline-run-<time>-<id>``)."""
        folder = os.path.join(self.settings["dir"], "wandb")
        return os.path.isdir(folder) and any(
            name.startswith("offline-run-") and name.endswith(f"-{run_id}") for name in os.listdir(folder)
        )

    def finish(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            try:
                run.finish()
            except Exception as error:
                return self._stop(error, None, started=True)
            import wandb

            # Now, not in W&B's exit hook: submitit requeues a preempted cell right after this run closes,
            # and Slurm then ends every process of the step, W&B's service among them, before that hook.
            try:
                wandb.teardown()
            except (Exception, SystemExit) as error:  # SystemExit: the service's own exit status
                self._stop(error, None, started=True)

    def _stop(self, error: BaseException, step: int | None, started: bool) -> None:
        self.run, self.stopped = None, True
        logging.getLogger(METRICS_LOGGER).warning(
            "W&B stopped %s (%s: %s)%s. The W&B run holds what was logged before; this run goes on without W&B "
            "(metrics.jsonl has every metric), and the next run resumes the W&B run",
            f"at step {step}" if step is not None else "while finishing",
            type(error).__name__,
            " ".join(str(error).split()),
            "; its service process has probably ended, as a Slurm step's stop signal ends every process of the step"
            if started
            else "",
        )
        # W&B's exit hook would retry the lost connection and print its traceback at exit: drop the hook
        # through W&B's own cleanup of it (private; where a W&B version keeps it elsewhere, the traceback
        # stays). Not wandb.teardown(), as finish() does with a live service: with the service gone it fails
        # half-way and leaves W&B's event-loop thread running into interpreter exit, which then aborted the
        # process (3 runs in 16).
        with contextlib.suppress(Exception):
            from wandb.sdk import wandb_setup

            wandb_setup._singleton._connection._cleanup()  # type: ignore[union-attr, misc]


class MetricSinks:
    """Several sinks as one; no sink at all on ranks other than 0."""

    def __init__(self, sinks: Iterable[MetricSink] = ()) -> None:
        self.sinks = list(sinks)

    def log(self, metrics: Mapping[str, float | None], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def finish(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.finish()


def build_metric_sinks(
    logger_cfg: LoggerConfig, output_dir: str, config: dict[str, Any], is_main: bool, training: bool
) -> MetricSinks:
    """The sinks ``logger_cfg`` (a config's ``logger`` section) asks for, writing into ``output_dir``:
    the history always, W&B for training runs (an eval's result is one line in its history)."""
    if not is_main:
        return MetricSinks()
    sinks: list[MetricSink] = [JsonlSink(os.path.join(output_dir, METRICS_HISTORY))]
    if training and resolve_wandb_mode(logger_cfg.wandb.mode) != "disabled":
        sinks.append(WandbSink(logger_cfg.wandb, output_dir, config))
    return MetricSinks(sinks)


def read_history(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """A ``metrics.jsonl`` history in step order, one entry per (step, metric names): where a
        resumed run logged a step again, its later entry wins. Lines that are not such entries (a torn
    last line of a killed run, anything else) are skipped."""
    entries: dict[tuple[int, tuple[str, ...]], dict[str, Any]] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                entry = json.loads(line)
            except (ValueError, RecursionError):  # not JSON, or nested past the parser: not ours
                continue
            step = entry.get("step") if isinstance(entry, dict) else None
            if isinstance(step, int) and not isinstance(step, bool):
                names = tuple(sorted(k for k in entry if k not in ("step", "logged_at")))
                entries[(entry["step"], names)] = entry
    return [entries[k] for k in sorted(entries, key=lambda k: k[0])]
