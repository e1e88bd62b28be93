"""What run folders say about their runs, for the tools that report them (``make_tables.py``,
``plot_runs.py``): a run's record (metrics, model, data), every run under some folders, a sweep's cells with
their status, and the paper's numbers a run reproduces. Every file is the user's: anything may be in it,
and what is not a cat run's file is a DataError naming it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml
from hydra.errors import HydraException

import cat.classification.schema  # noqa: F401  (registers schema/cls)
import cat.mm.schema  # noqa: F401  (registers schema/det and schema/seg: needs none of the OpenMMLab stack)
from cat.classification.metrics import BEST
from cat.errors import ConfigError, DataError, RunDirLockedError
from cat.paper import available_tables, paper_table
from cat.runtime import RunDirLock
from cat.runtime.config_help import unnamed_keys
from cat.runtime.ownership import EARLIER_RUNS
from cat.runtime.schema import schema_of

from .sweeps import expand_sweep

__all__ = [
    "RUN_METRICS",
    "read_run_file",
    "run_record",
    "collect_runs",
    "run_metric",
    "runs_of_row",
    "sweep_cells",
    "paper_values",
]

# The paper's metric names (cat/paper_tables.yaml) -> the metrics.json keys of a run (the first
# one present is used: a training run's best top-1 over its last epoch's, then an evaluation's; then the names runs
# recorded before one name per metric had: cat.classification.metrics) and the factor to the paper's percent scale
# (mmdet's COCO metrics are fractions).
RUN_METRICS = {
    "top1": ((f"val/{BEST}", "val/top1", "eval/top1", BEST, "top1"), 1.0),
    "AP_b": (("bbox_mAP",), 100.0),
    "AP_b50": (("bbox_mAP_50",), 100.0),
    "AP_b75": (("bbox_mAP_75",), 100.0),
    "AP_m": (("segm_mAP",), 100.0),
    "AP_m50": (("segm_mAP_50",), 100.0),
    "AP_m75": (("segm_mAP_75",), 100.0),
    "mIoU": (("mIoU",), 1.0),
}


def read_run_file(path: Path, kind: type = dict) -> Any:
    """A run's JSON or YAML file, parsed (``kind``: what it must hold); a DataError naming the file
    if it is not that. YAML is read with the safe loader: no file can make this run code."""
    try:
        value = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    except (ValueError, yaml.YAMLError) as error:  # json and yaml parse errors (and non-UTF-8 text)
        raise DataError(f"{path} is not valid {path.suffix[1:].upper()} ({str(error).splitlines()[0]})") from None
    except RecursionError:
        raise DataError(f"{path} is nested too deeply to be a cat run's file") from None
    if not isinstance(value, kind):
        raise DataError(f"{path} does not hold a {kind.__name__}, as a cat run's file does")
    return value


def _section(config: dict[str, Any], key: str, path: Path) -> dict[str, Any]:
    value = config.get(key) or {}
    if not isinstance(value, dict):
        raise DataError(f"{path}: '{key}' is a {type(value).__name__}, not a mapping as in a cat run's config")
    return value


def run_record(folder: Path) -> dict[str, Any]:
    """What a run folder says about its run: metrics (empty if it has none yet), model and data."""
    config_path, metrics_path = folder / "config.yaml", folder / "metrics.json"
    config = read_run_file(config_path) if config_path.is_file() else {}
    metrics = read_run_file(metrics_path) if metrics_path.is_file() else {}
    for key in (k for keys, _ in RUN_METRICS.values() for k in keys):
        value = metrics.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise DataError(f"{metrics_path}: {key} is {value!r:.60}, not a number")
        if value is not None and not math.isfinite(value):  # Python's JSON reads NaN and Infinity; cat writes neither
            raise DataError(f"{metrics_path}: {key} is {value}, not a finite number as a cat run records")
    model, data = _section(config, "model", config_path), _section(config, "data", config_path)
    return {
        "dir": str(folder),
        "mode": config.get("mode", "train"),
        "metrics": metrics,
        "name": config.get("name"),
        "model": model.get("name"),
        "model_args": model.get("kwargs") or {},
        "img_size": data.get("img_size"),
        "dataset": data.get("name"),
    }


def collect_runs(folders: list[str]) -> list[dict[str, Any]]:
    """Every run under ``folders``: its metrics, model name and input size. Runs a folder was started over
    from (``resume=false`` keeps them in ``earlier_runs/``) are not the folder's result and are left out, unless
    a folder given is inside ``earlier_runs/`` itself."""
    return [
        run_record(metrics_path.parent)
        for folder in folders
        for metrics_path in sorted(Path(folder).rglob("metrics.json"))
        if (metrics_path.parent / "config.yaml").is_file()
        and EARLIER_RUNS not in metrics_path.relative_to(folder).parts
    ]


def run_metric(run: dict[str, Any], name: str) -> float | None:
    """The run's value of the paper's metric ``name``, on the paper's scale (None if it has none)."""
    keys, scale = RUN_METRICS[name]
    value = next((run["metrics"][k] for k in keys if run["metrics"].get(k) is not None), None)
    return None if value is None else value * scale


def runs_of_row(row: dict[str, Any], table: dict[str, Any], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Detection/segmentation rows match runs by preset name; classification rows by model, its
    options (those any row of the table sets for this model, e.g. Table 5's head_dim and reweight)
    and input size."""
    if "experiment" in row:
        return [r for r in runs if r["name"] == row["experiment"]]
    options = {k for other in table["rows"] if other.get("model") == row["model"] for k in other.get("model_args", {})}
    wanted = row.get("model_args", {})
    return [
        r
        for r in runs
        if r["model"] == row["model"]
        and r["dataset"] == table["dataset"]
        and r["img_size"] in (None, row["img_size"])
        and all(r["model_args"].get(k) == wanted.get(k) for k in options)
    ]


def _job_schema(job_name: Any) -> type:
    """The schema of a cat trainer's job (``train_cls``, ``train_det``, ``train_seg``); a ConfigError otherwise."""
    name = job_name.removeprefix("train_") if isinstance(job_name, str) else None
    if name not in ("cls", "det", "seg"):
        raise ConfigError(f"hydra.job.name={job_name!r} is not a cat trainer's job")
    return schema_of(name)


def sweep_cells(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every cell the sweep launched (from ``multirun.yaml``) or has a folder for, with its status:
    finished, stopped (saved on a signal; relaunch the sweep to resume it), running, failed (a
    folder, no result, no live run: its log.txt ends with why) or missing (no folder: not started)."""
    try:
        multirun = read_run_file(sweep_dir / "multirun.yaml")["hydra"]
        expected = set(expand_sweep(multirun["overrides"]["task"], (multirun.get("sweeper") or {}).get("params")))
        # As in the cells' folder names: the list the sweep recorded (none: every override names a cell), or, where
        # it recorded the trainer's interpolation (computed from the schema), that list from the job's schema.
        recorded = multirun["job"]["config"]["override_dirname"].get("exclude_keys") or []
        unnamed = set(unnamed_keys(_job_schema(multirun["job"]["name"])) if isinstance(recorded, str) else recorded)
    except (KeyError, TypeError, AttributeError, HydraException, ConfigError) as error:
        raise DataError(f"{sweep_dir / 'multirun.yaml'} is not a Hydra sweep's record we can read ({error})") from None
    cells = []
    for folder in sorted(p for p in sweep_dir.iterdir() if (p / "overrides.yaml").is_file()):
        try:
            (overrides,) = expand_sweep(read_run_file(folder / "overrides.yaml", list))
        except (HydraException, ConfigError, ValueError) as error:
            raise DataError(f"{folder / 'overrides.yaml'} holds no Hydra overrides of one cell ({error})") from None
        record = run_record(folder)
        if record["metrics"]:
            status = "stopped" if record["metrics"].get("preempted") else "finished"
        else:
            status = "running" if _live_run_in(folder) else "failed"
        cells.append({**record, "overrides": overrides, "status": status})
        expected.discard(overrides)
    cells += [{"overrides": cell, "status": "missing", "metrics": {}, "dir": None} for cell in sorted(expected)]
    for cell in cells:  # what names a cell's group: its overrides but the seed and the unnamed keys
        cell["group"] = tuple(o for o in cell["overrides"] if o.split("=")[0] not in unnamed | {"seed"})
    return cells


def _live_run_in(folder: Path) -> bool:
    try:
        return RunDirLock(str(folder)).in_use()
    except RunDirLockedError:  # a lock that is not cat's record: no run of ours holds the cell
        return False


def paper_values(record: dict[str, Any], metrics: list[str]) -> dict[str, float]:
    """The paper's numbers for the first table row this run reproduces (none if no row matches)."""
    for number in available_tables():
        table = paper_table(number)
        for row in table["rows"]:
            if runs_of_row(row, table, [record]):
                return {m: row["paper"][m] for m in metrics if m in row.get("paper", {})}
    return {}
