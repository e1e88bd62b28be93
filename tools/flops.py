#!/usr/bin/env python
"""Parameters and FLOPs (multiply-accumulates, as the paper counts them) of any timm model.

python tools/flops.py ca_deit_tiny deit_tiny_patch16_224                   # 224x224
python tools/flops.py ca_deit_tiny --img-size 224 --img-size 1024 --img-size 800 1280
python tools/flops.py ca_deit_small --img-size 512 768 --json            # H=512, W=768
python tools/flops.py --table 2            # the paper's Table 2 (or 3, 4, 5), ours beside the paper's numbers
python tools/flops.py --det mask_rcnn_ca_pvt_t_1x mask_rcnn_pvt_t_1x    # whole detectors at 800x1280
python tools/flops.py --seg fpn_ca_pvt_t_40k --img-size 512 2048        # whole segmentors
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cat  # noqa: F401  (registers cat's models with timm)
from cat.flops import model_cost
from cat.paper import available_tables, paper_table
from cat.runtime import report_user_errors
from cat.toolkit import positive_int


def measure(name: str, img_size: tuple[int, int], **model_args: object) -> dict[str, object]:
    params, macs = model_cost(name, img_size, **model_args)
    return {"model": name, "img_size": list(img_size), "params": params, "flops": macs}


CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def experiments(task: str) -> list[str]:
    """The presets of ``train_det.py`` (``task='det'``) or ``train_seg.py`` (``'seg'``)."""
    return sorted(path.stem for path in (CONFIGS / task / "experiment").glob("*.yaml"))


def measure_dense(task: str, experiment: str, hw: tuple[int, int]) -> dict[str, object]:
    """A whole detector (``task='det'``) or segmentor (``'seg'``) from its train_det/train_seg preset."""
    from hydra import compose, initialize_config_dir

    from cat.mm.flops import detector_macs, segmentor_macs
    from cat.runtime.schema import schema_of, typed_config

    config_dir = CONFIGS / task
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"experiment={experiment}"])
    model = typed_config(cfg, schema_of(task)).model
    params, macs = (detector_macs if task == "det" else segmentor_macs)(model, hw)
    return {"model": experiment, "img_size": list(hw), "params": params, "flops": macs}


def _relative_error(ours: float, paper: float | None) -> float | None:
    return None if paper is None else (ours - paper) / paper


def compare_table(number: int) -> list[dict[str, object]]:
    """Every row of the paper's table ``number`` measured, beside the paper's params and GFLOPs."""
    table = paper_table(number)
    rows = []
    for row in table["rows"]:
        if "experiment" in row:  # whole detectors / segmentors (Tables 3 and 4)
            ours = measure_dense(table["task"], row["experiment"], tuple(row["img_size"]))
        else:
            ours = measure(row["model"], (row["img_size"], row["img_size"]), **row.get("model_args", {}))
        params_m, gflops = ours["params"] / 1e6, ours["flops"] / 1e9
        tolerance = row.get("tolerance", table["tolerance"])
        errors = [
            e
            for e in (_relative_error(params_m, row.get("params_m")), _relative_error(gflops, row["gflops"]))
            if e is not None
        ]
        rows.append(
            {
                **row,
                "ours_params_m": params_m,
                "ours_gflops": gflops,
                "tolerance": tolerance,
                "within_tolerance": all(abs(e) <= tolerance for e in errors),
            }
        )
    return rows


def _print_table(number: int, rows: list[dict[str, object]]) -> None:
    fmt = lambda v: "—" if v is None else f"{v:.1f}"  # noqa: E731
    print(f"Table {number}: {paper_table(number)['title']}")
    print("| model | name | input | params (M) | paper | GFLOPs | paper | ok |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        paper_note = " (target)" if r.get("target") else ""
        name = r.get("model") or r["experiment"]
        name += "".join(f" {k}={v}" for k, v in r.get("model_args", {}).items())
        size = "x".join(map(str, r["img_size"])) if isinstance(r["img_size"], list) else f"{r['img_size']}²"
        print(
            f"| {r['label']} | `{name}` | {size} "
            f"| {r['ours_params_m']:.1f} | {fmt(r.get('params_m'))} | {r['ours_gflops']:.2f} "
            f"| {fmt(r['gflops'])}{paper_note} | {'yes' if r['within_tolerance'] else 'NO'} |"
        )


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", help="timm model names (cat's models are registered)")
    parser.add_argument(
        "--table",
        type=int,
        choices=available_tables(),
        help="reproduce table N of the paper (exit status 1 if a row is outside its tolerance)",
    )
    parser.add_argument(
        "--img-size",
        nargs="+",
        type=positive_int,
        action="append",
        metavar=("H", "W"),
        help="input resolution: H (square) or H W; repeat the flag for several (default 224)",
    )
    parser.add_argument(
        "--det",
        nargs="+",
        metavar="EXPERIMENT",
        choices=experiments("det"),
        help="train_det.py presets: whole detectors "
        "(backbone, FPN, RPN, RoI heads on 1000 proposals; default input 800x1280)",
    )
    parser.add_argument(
        "--seg",
        nargs="+",
        metavar="EXPERIMENT",
        choices=experiments("seg"),
        help="train_seg.py presets: whole segmentors (default input 512x2048)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list of raw counts")
    args = parser.parse_args(argv)
    if args.table is not None:
        rows = compare_table(args.table)
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            _print_table(args.table, rows)
        return 0 if all(r["within_tolerance"] for r in rows) else 1
    if not (args.models or args.det or args.seg):
        parser.error("give model names, --det/--seg presets or --table N")

    resolutions = []
    for size in args.img_size or []:
        if len(size) > 2:
            parser.error(f"--img-size takes H or H W, got {size}; repeat the flag for several resolutions")
        resolutions.append((size[0], size[-1]))
    rows = [measure(m, r) for m in args.models for r in resolutions or [(224, 224)]]
    rows += [measure_dense("det", e, r) for e in args.det or [] for r in resolutions or [(800, 1280)]]
    rows += [measure_dense("seg", e, r) for e in args.seg or [] for r in resolutions or [(512, 2048)]]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'model':<32} {'input':>11} {'params (M)':>11} {'GFLOPs':>9}")
    for row in rows:
        h, w = row["img_size"]
        print(f"{row['model']:<32} {f'{h}x{w}':>11} {row['params'] / 1e6:>11.2f} {row['flops'] / 1e9:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
