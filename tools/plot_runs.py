#!/usr/bin/env python
"""Learning curves of classification runs as one picture: train loss, validation top-1 and the learning
rate against the epoch, several runs side by side, from each run's ``metrics.jsonl`` (the per-epoch rows
``train_cls.py`` writes).

Each folder given is a run (it holds ``metrics.jsonl``) or a sweep (``train_cls.py -m``; it holds Hydra's
``multirun.yaml``). A sweep's cells that differ only by ``seed`` are one curve, their mean with a band of
± one standard deviation where two or more seeds have the epoch. Where ``cat/paper_tables.yaml`` has the
paper's top-1 for a run's model (as ``make_tables.py`` matches them), the top-1 panel draws it as a dashed
line in the curve's colour.

    python tools/plot_runs.py outputs/cls/quickstart --out docs/quickstart_curves.png
    python tools/plot_runs.py outputs/cls/sweeps/table5_ablation outputs/cls/deit_s --out curves.svg
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cat.errors import DataError, shortened
from cat.runtime import report_user_errors
from cat.runtime.metric_sinks import METRICS_HISTORY, read_history
from cat.toolkit.runs import paper_values, run_record, sweep_cells

# (metrics.jsonl key of the per-epoch row, the panel's title)
PANELS = (("train/loss", "train loss"), ("val/top1", "val top-1 (%)"), ("train/lr", "learning rate"))
FORMATS = (".png", ".svg")
MAX_EPOCH = 10**6
MAX_VALUE = 1e100


@dataclass
class Curve:
    """One line of the picture: a run, or a sweep's seeds of one cell (``histories``: one per seed)."""

    label: str
    histories: list[dict[str, dict[int, float]]] = field(default_factory=list)  # key -> epoch -> value
    paper_top1: float | None = None


def epoch_values(folder: Path) -> dict[str, dict[int, float]]:
    """Each panel's values by epoch from a run's ``metrics.jsonl`` (a resumed run's later entry wins)."""
    path = folder / METRICS_HISTORY
    try:
        history = read_history(path)
    except OSError as error:
        raise DataError(f"{path} cannot be read ({type(error).__name__}: {error.strerror})") from None
    values: dict[str, dict[int, float]] = {key: {} for key, _ in PANELS}
    for entry in history:
        epoch = entry.get("epoch")
        if type(epoch) is not int or not 0 <= epoch <= MAX_EPOCH:
            continue  # an interval row (steps), not an epoch's; or an epoch no run reaches
        for key, _ in PANELS:
            value = entry.get(key)
            # a diverged run's inf, or a number whose square overflows the band: not drawn
            if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= MAX_VALUE:
                values[key][epoch] = float(value)
    return values


def _paper_top1(folder: Path) -> float | None:
    return paper_values(run_record(folder), ["top1"]).get("top1")


def curves_of(folder: Path) -> list[Curve]:
    """The curves a folder given on the command line draws: its run's, or one per cell group of its sweep."""
    if (folder / "multirun.yaml").is_file():
        groups: dict[tuple[str, ...], Curve] = {}
        for cell in sweep_cells(folder):
            if cell["dir"] is None or not (Path(cell["dir"]) / METRICS_HISTORY).is_file():
                continue  # not started, or failed before its first line
            curve = groups.setdefault(cell["group"], Curve("", paper_top1=_paper_top1(Path(cell["dir"]))))
            curve.histories.append(epoch_values(Path(cell["dir"])))
        if not groups:
            raise DataError(f"{folder}: no cell of the sweep has a {METRICS_HISTORY} yet")
        shared = set.intersection(*(set(group) for group in groups))  # named once, in the title
        for group, curve in groups.items():
            curve.label = f"{folder.name}: {', '.join(o for o in group if o not in shared) or '(base config)'}"
        return list(groups.values())
    if (folder / METRICS_HISTORY).is_file():
        return [Curve(folder.name, [epoch_values(folder)], _paper_top1(folder))]
    raise DataError(f"{folder}: neither a run ({METRICS_HISTORY}) nor a sweep (multirun.yaml) folder")


def mean_band(histories: list[dict[int, float]]) -> tuple[list[int], list[float], list[float]]:
    """Epochs, the mean over the histories that have each, and their standard deviation (0 for one)."""
    epochs = sorted({e for h in histories for e in h})
    values = [[h[e] for h in histories if e in h] for e in epochs]
    return epochs, [statistics.fmean(v) for v in values], [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]


def plot(curves: list[Curve], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # an SVG's labels stay text: searchable, editable
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, curve in enumerate(curves):
        color = colors[index % len(colors)]
        seeds = len(curve.histories)
        for ax, (key, _) in zip(axes, PANELS, strict=True):
            epochs, mean, std = mean_band([h[key] for h in curve.histories])
            if not epochs:
                continue
            # matplotlib reads $...$ in a label as mathtext: a run's name is text
            label = curve.label.replace("$", r"\$") + (f" ({seeds} seeds)" if seeds > 1 else "")
            ax.plot(epochs, mean, color=color, label=label, marker="." if len(epochs) < 30 else None)
            if seeds > 1:
                ax.fill_between(
                    epochs,
                    [m - s for m, s in zip(mean, std, strict=True)],
                    [m + s for m, s in zip(mean, std, strict=True)],
                    color=color,
                    alpha=0.2,
                )
            if key == "val/top1" and curve.paper_top1 is not None:
                ax.axhline(
                    curve.paper_top1, color=color, linestyle="--", linewidth=1, label=f"paper {curve.paper_top1}"
                )
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        if key == "train/lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    # The legend from the panel that has the most lines: a run without validation rows has none in the top-1 panel.
    handles, labels = max((ax.get_legend_handles_labels() for ax in axes), key=lambda pair: len(pair[1]))
    fig.legend(handles, labels, loc="lower center", ncol=max(1, min(2, len(labels))), fontsize="small", frameon=False)
    fig.tight_layout(rect=(0, 0.06 * ((len(labels) + 1) // 2) + 0.04, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, help="run folders (metrics.jsonl) or sweep folders")
    parser.add_argument("--out", type=Path, required=True, help="the picture: FILE.png or FILE.svg")
    args = parser.parse_args(argv)
    if args.out.suffix not in FORMATS:
        parser.error(f"--out {args.out}: expected a .png or .svg file")
    try:  # a path the OS will not look at (a name over its limit, a link only its owner may follow) is one line too
        missing = [str(f) for f in args.folders if not f.is_dir()]
        if missing:
            raise DataError(f"not a folder: {', '.join(missing)}")
        curves = [curve for folder in args.folders for curve in curves_of(folder)]
    except OSError as error:
        raise DataError(f"{shortened(error.filename or '')}: cannot be read ({error.strerror or error})") from None
    if not any(history[key] for curve in curves for history in curve.histories for key, _ in PANELS):
        raise DataError(f"{', '.join(map(str, args.folders))}: no run has an epoch's row in its {METRICS_HISTORY} yet")
    if args.out.is_dir():
        raise DataError(f"--out {args.out}: a folder; give the picture's file name")
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        plot(curves, args.out)
    except OSError as error:
        raise DataError(f"--out {args.out}: cannot be written ({error.strerror or error})") from None
    print(f"{args.out}: {len(curves)} curve(s) from {len(args.folders)} folder(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
