#!/usr/bin/env python
"""Collect run results into the paper's tables, ours beside the paper's numbers (Markdown).

Scans the given folders for ``metrics.json`` files written by ``train_cls.py`` (and, where present,
``train_det.py``/``train_seg.py``), reads each run's resolved ``config.yaml`` beside it to know the
model and resolution, and fills the rows of the tables in ``cat/paper_tables.yaml``. Rows without
a run are marked "not run"; for several runs of one row the best is shown.

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

# Per table: the metric's label, the metrics.json key (and a preferred key), and the factor to the
# paper's percent scale (mmdet's COCO metric is a fraction).
TABLE_METRICS = {
    2: ("top-1 (%)", "top1", "best_top1", 1.0),
    3: ("box AP", "bbox_mAP", None, 100.0),
    4: ("mIoU (%)", "mIoU", None, 1.0),
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
            model = config.get("model", {})
            runs.append(
                {
                    "dir": str(metrics_path.parent),
                    "mode": config.get("mode", "train"),
                    "metrics": metrics,
                    "name": config.get("name"),
                    "model": model.get("name"),
                    "img_size": config.get("data", {}).get("img_size"),
                    "dataset": config.get("data", {}).get("name"),
                }
            )
    return runs


def _value(run: dict[str, Any], key: str, preferred: str | None, scale: float = 1.0) -> float | None:
    metrics = run["metrics"]
    value = metrics[preferred] if preferred and preferred in metrics else metrics.get(key)
    return None if value is None else value * scale


def fill_table(number: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    table = paper_table(number)
    _, key, fallback, scale = TABLE_METRICS[number]
    rows = []
    for row in table["rows"]:
        if "experiment" in row:  # detection/segmentation presets are matched by run name
            matching = [r for r in runs if r["name"] == row["experiment"] and _value(r, key, fallback) is not None]
        else:
            matching = [
                r
                for r in runs
                if r["model"] == row["model"]
                and r["dataset"] == table["dataset"]
                and r["img_size"] in (None, row["img_size"])
                and _value(r, key, fallback) is not None
            ]
        best = max(matching, key=lambda r: _value(r, key, fallback), default=None)
        rows.append(
            {
                **row,
                "ours": None if best is None else _value(best, key, fallback, scale),
                "run": None if best is None else best["dir"],
            }
        )
    return rows


def to_markdown(number: int, rows: list[dict[str, Any]]) -> str:
    metric = TABLE_METRICS[number][0]
    fmt = lambda v, p=1: "—" if v is None else f"{v:.{p}f}"  # noqa: E731
    lines = [
        f"### Table {number}: {paper_table(number)['title']}",
        "",
        f"| model | params (M), paper | GFLOPs, paper | {metric}, ours | {metric}, paper | run |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        run = "not run" if r["run"] is None else f"`{r['run']}`"
        lines.append(
            f"| {r['label']} | {fmt(r.get('params_m'))} | {fmt(r.get('gflops'))} | {fmt(r['ours'], 2)} "
            f"| {fmt(r.get('paper_metric'), 1)} | {run} |"
        )
    return "\n".join(lines)


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", help="folders to search for runs (metrics.json + config.yaml)")
    parser.add_argument("--table", type=int, nargs="+", default=None, help="tables to print (default: all)")
    parser.add_argument("--out", default=None, help="also write the Markdown to this file")
    args = parser.parse_args(argv)
    missing = [folder for folder in args.folders if not Path(folder).is_dir()]
    if missing:
        raise DataError(f"not a folder: {', '.join(missing)}")

    runs = collect_runs(args.folders)
    tables = args.table or [t for t in available_tables() if t in TABLE_METRICS]
    text = "\n\n".join(to_markdown(t, fill_table(t, runs)) for t in tables)
    print(text)
    print(f"\n{len(runs)} runs found under {', '.join(args.folders)}")
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
