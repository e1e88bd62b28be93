#!/usr/bin/env python
"""Collect run results into the paper's tables, ours beside the paper's numbers (Markdown).

Scans the given folders for ``metrics.json`` files written by ``train_cls.py`` (and, where present,
``train_det.py``/``train_seg.py``), reads each run's resolved ``config.yaml`` beside it to know the
model (and its options) and resolution, and fills the rows of the tables in
``cat/paper_tables.yaml``: every metric the paper prints for a row (top-1; box and mask AP; mIoU)
beside ours. Rows without a run are marked "not run"; for several runs of one row the best (by the
table's first metric) is shown.

    python tools/make_tables.py outputs/                    # every table
    python tools/make_tables.py outputs/cls --table 2 --out docs/results.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from cat.errors import DataError
from cat.paper import available_tables, paper_table
from cat.runtime import report_user_errors

# The paper's metric names (cat/paper_tables.yaml) -> the metrics.json keys of a run (the first
# one present is used: best_top1 over the last epoch's top1) and the factor to the paper's percent
# scale (mmdet's COCO metrics are fractions).
RUN_METRICS = {
    "top1": (("best_top1", "top1"), 1.0),
    "AP_b": (("bbox_mAP",), 100.0),
    "AP_b50": (("bbox_mAP_50",), 100.0),
    "AP_b75": (("bbox_mAP_75",), 100.0),
    "AP_m": (("segm_mAP",), 100.0),
    "AP_m50": (("segm_mAP_50",), 100.0),
    "AP_m75": (("segm_mAP_75",), 100.0),
    "mIoU": (("mIoU",), 1.0),
}


def collect_runs(folders: list[str]) -> list[dict[str, Any]]:
    """Every run under ``folders``: its metrics, model name and input size."""
    runs = []
    for folder in folders:
        for metrics_path in sorted(Path(folder).rglob("metrics.json")):
            config_path = metrics_path.parent / "config.yaml"
            if not config_path.is_file():
                continue
            config = yaml.safe_load(config_path.read_text())
            try:
                metrics = json.loads(metrics_path.read_text())
            except ValueError as error:
                raise DataError(f"{metrics_path} is not valid JSON ({error})") from None
            model = config.get("model") or {}
            runs.append(
                {
                    "dir": str(metrics_path.parent),
                    "mode": config.get("mode", "train"),
                    "metrics": metrics,
                    "name": config.get("name"),
                    "model": model.get("name"),
                    "model_args": model.get("kwargs") or {},
                    "img_size": config.get("data", {}).get("img_size"),
                    "dataset": config.get("data", {}).get("name"),
                }
            )
    return runs


def run_metric(run: dict[str, Any], name: str) -> float | None:
    """The run's value of the paper's metric ``name``, on the paper's scale (None if it has none)."""
    keys, scale = RUN_METRICS[name]
    value = next((run["metrics"][k] for k in keys if run["metrics"].get(k) is not None), None)
    return None if value is None else value * scale


def _runs_of_row(row: dict[str, Any], table: dict[str, Any], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
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


def fill_table(number: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table's rows, each with ``ours`` (metric -> value) from its best run and that run's folder."""
    table = paper_table(number)
    first = next(iter(table["metrics"]))
    rows = []
    for row in table["rows"]:
        matching = [r for r in _runs_of_row(row, table, runs) if run_metric(r, first) is not None]
        best = max(matching, key=lambda r: run_metric(r, first), default=None)
        ours = {name: None if best is None else run_metric(best, name) for name in table["metrics"]}
        rows.append({**row, "ours": ours, "run": None if best is None else best["dir"]})
    return rows


def to_markdown(number: int, rows: list[dict[str, Any]]) -> str:
    table = paper_table(number)
    fmt = lambda v, p=1: "—" if v is None else f"{v:.{p}f}"  # noqa: E731
    metric_columns = "".join(f" {label}, ours | {label}, paper |" for label in table["metrics"].values())
    lines = [
        f"### Table {number}: {table['title']}",
        "",
        f"| model | params (M), paper | GFLOPs, paper |{metric_columns} run |",
        "|---|---|---|" + "---|---|" * len(table["metrics"]) + "---|",
    ]
    for r in rows:
        run = "not run" if r["run"] is None else f"`{r['run']}`"
        metrics = "".join(
            f" {fmt(r['ours'][name], 2)} | {fmt(r.get('paper', {}).get(name))} |" for name in table["metrics"]
        )
        lines.append(f"| {r['label']} | {fmt(r.get('params_m'))} | {fmt(r.get('gflops'))} |{metrics} {run} |")
    return "\n".join(lines)


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", help="folders to search for runs (metrics.json + config.yaml)")
    parser.add_argument(
        "--table", type=int, nargs="+", choices=available_tables(), help="tables to print (default: all)"
    )
    parser.add_argument("--out", default=None, help="also write the Markdown to this file")
    args = parser.parse_args(argv)
    missing = [folder for folder in args.folders if not Path(folder).is_dir()]
    if missing:
        raise DataError(f"not a folder: {', '.join(missing)}")

    runs = collect_runs(args.folders)
    tables = args.table or available_tables()
    text = "\n\n".join(to_markdown(t, fill_table(t, runs)) for t in tables)
    print(text)
    print(f"\n{len(runs)} runs found under {', '.join(args.folders)}")
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
