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

A sweep folder (``train_*.py -m``; it holds Hydra's ``multirun.yaml``) gets its own table instead:
one row per group of cells that differ only by ``seed``, with the mean ± std over the seeds that
finished and their count, the paper's number where a table row matches, and every cell of the
sweep accounted for (finished, stopped, running, failed, missing); where an unfinished cell has a
metric history (``metrics.jsonl``), the status says how far it got, and for a failed cell how its
``log.txt`` ends (the run's error):

    python tools/make_tables.py outputs/cls/sweeps/table5_ablation --out t5.md --csv t5.csv
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path
from typing import Any

from cat.errors import DataError
from cat.paper import available_tables, paper_table
from cat.runtime import report_user_errors
from cat.runtime.logger import last_log_line
from cat.runtime.metric_sinks import METRICS_HISTORY, read_history
from cat.toolkit.runs import RUN_METRICS, collect_runs, paper_values, run_metric, runs_of_row, sweep_cells

# Validation metrics in a metrics.jsonl history (classification, detection, segmentation) and
# their labels in a progress note.
HISTORY_METRICS = (("val/top1", "top1"), ("coco/bbox_mAP", "box mAP"), ("coco/segm_mAP", "mask mAP"), ("mIoU", "mIoU"))


def history_progress(folder: Path) -> str | None:
    """How far a run's ``metrics.jsonl`` got: its last step and latest validation metric."""
    path = folder / METRICS_HISTORY
    if not path.exists():
        return None
    try:
        history = read_history(path)
    except OSError as error:
        raise DataError(f"{path} cannot be read ({type(error).__name__}: {error.strerror})") from None
    if not history:
        return None
    text = f"step {history[-1]['step']}"
    for name, label in HISTORY_METRICS:
        values = [e[name] for e in history if isinstance(e.get(name), (int, float))]
        if values:
            return f"{text}, {label} {values[-1]:.2f}"
    return text


def log_ending(folder: Path, limit: int = 160) -> str | None:
    """The last line of a run's ``log.txt`` without its time stamp (a failed run's error), cut to ``limit``
    characters and made safe for a Markdown cell; None if there is none."""
    path = folder / "log.txt"
    try:
        line = last_log_line(str(path))
    except FileNotFoundError:
        return None
    except OSError as error:
        raise DataError(f"{path} cannot be read ({type(error).__name__}: {error.strerror})") from None
    if line is None:
        return None
    line = line.replace("|", "\\|")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def fill_table(number: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table's rows, each with ``ours`` (metric -> value) from its best run and that run's folder."""
    table = paper_table(number)
    first = next(iter(table["metrics"]))
    rows = []
    for row in table["rows"]:
        matching = [r for r in runs_of_row(row, table, runs) if run_metric(r, first) is not None]
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


def summarize_sweep(cells: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """The sweep's metrics and one row per group of cells that differ only by seed."""
    done = [c for c in cells if c["status"] == "finished"]
    metrics = [m for m in RUN_METRICS if any(run_metric(c, m) is not None for c in done)]
    metrics = [m for m in metrics if m in ("top1", "AP_b", "AP_m", "mIoU")] or metrics  # the headline ones
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for cell in cells:
        groups.setdefault(cell["group"], []).append(cell)
    rows = []
    for key, members in groups.items():
        finished = [c for c in members if c["status"] == "finished"]
        row: dict[str, Any] = {"cell": ",".join(key) or "(base config)", "seeds": len(finished), "cells": len(members)}
        for m in metrics:
            values = [v for v in (run_metric(c, m) for c in finished) if v is not None]
            row[f"{m}_mean"] = statistics.fmean(values) if values else None
            row[f"{m}_std"] = statistics.stdev(values) if len(values) > 1 else None
        paper = paper_values(finished[0], metrics) if finished else {}
        row.update({f"{m}_paper": paper.get(m) for m in metrics})
        counts = {
            s: sum(c["status"] == s for c in members) for s in ("finished", "stopped", "running", "failed", "missing")
        }
        row["status"] = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        progress = [
            f"{c['status']} at {note}"
            for c in members
            if c["status"] in ("stopped", "running") and (note := history_progress(Path(c["dir"])))
        ]
        progress += [
            f"failed, its log ends: {note}"
            for c in members
            if c["status"] == "failed" and (note := log_ending(Path(c["dir"])))
        ]
        if progress:
            row["status"] += f" ({'; '.join(progress)})"
        rows.append(row)
    return metrics, rows


def _mean_std(mean: float | None, std: float | None) -> str:
    if mean is None:
        return "—"
    return f"{mean:.2f}" if std is None else f"{mean:.2f} ± {std:.2f}"


def sweep_markdown(sweep_dir: Path, metrics: list[str], rows: list[dict[str, Any]]) -> str:
    labels = {name: label for n in available_tables() for name, label in paper_table(n)["metrics"].items()}
    header = "".join(f" {labels[m]}, mean ± std | {labels[m]}, paper |" for m in metrics)
    lines = [
        f"### Sweep `{sweep_dir.name}` ({sweep_dir})",
        "",
        f"| cells | seeds |{header} status |",
        "|---|---|" + "---|---|" * len(metrics) + "---|",
    ]
    for r in rows:
        values = "".join(
            f" {_mean_std(r[f'{m}_mean'], r[f'{m}_std'])} | {'—' if r[f'{m}_paper'] is None else r[f'{m}_paper']} |"
            for m in metrics
        )
        lines.append(f"| {r['cell']} | {r['seeds']} |{values} {r['status']} |")
    return "\n".join(lines)


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", help="folders to search for runs (metrics.json + config.yaml)")
    parser.add_argument(
        "--table", type=int, nargs="+", choices=available_tables(), help="tables to print (default: all)"
    )
    parser.add_argument("--out", default=None, help="also write the Markdown to this file")
    parser.add_argument("--csv", default=None, help="sweep folders: also write their rows to this CSV file")
    args = parser.parse_args(argv)
    missing = [folder for folder in args.folders if not Path(folder).is_dir()]
    if missing:
        raise DataError(f"not a folder: {', '.join(missing)}")

    sweeps = [Path(f) for f in args.folders if (Path(f) / "multirun.yaml").is_file()]
    others = [f for f in args.folders if Path(f) not in sweeps]
    parts, csv_rows = [], []
    for sweep_dir in sweeps:
        metrics, rows = summarize_sweep(sweep_cells(sweep_dir))
        parts.append(sweep_markdown(sweep_dir, metrics, rows))
        csv_rows += [{"sweep": str(sweep_dir), **row} for row in rows]
    if others:
        runs = collect_runs(others)
        parts += [to_markdown(t, fill_table(t, runs)) for t in args.table or available_tables()]
        parts.append(f"{len(runs)} runs found under {', '.join(others)}")
    text = "\n\n".join(parts)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.csv and csv_rows:
        fields = list(dict.fromkeys(k for row in csv_rows for k in row))
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(csv_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
