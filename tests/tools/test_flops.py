"""tools/flops.py reproduces the paper's Tables 2 and 5 (params and FLOPs) and counts any timm model;
cat/paper_tables.yaml holds every number of Tables 2-5 (Tables 3 and 4: tests/mm/test_dense_flops.py)."""

from __future__ import annotations

import json
import math
import runpy

import pytest
import torch
from torch import nn

from cat.flops import count_macs
from cat.paper import available_tables, paper_table
from tests.conftest import REPO


@pytest.fixture
def run_flops(run_tool):
    return lambda *args: run_tool("flops", *args)


@pytest.mark.slow
def test_table2_within_tolerance(run_flops, capsys):
    rows = json.loads(run_flops("--table", "2", "--json"))
    assert len(rows) == 25
    for r in rows:
        for ours, paper in ((r["ours_params_m"], r["params_m"]), (r["ours_gflops"], r["gflops"])):
            if paper is not None:
                assert abs(ours - paper) / paper <= r["tolerance"], (r["label"], ours, paper)
        assert r["within_tolerance"]
    deit_t = next(r for r in rows if r["label"] == "DeiT-T")
    assert abs(deit_t["ours_gflops"] - deit_t["gflops"]) < 0.1
    # The markdown table of the same rows (printing them, not measuring them again).
    runpy.run_path(str(REPO / "tools" / "flops.py"))["_print_table"](2, rows)
    assert "| CA-PVT-T | `ca_pvt_tiny` | 224² | 12.2 | 12.2 |" in capsys.readouterr().out


def test_json_and_resolutions(run_flops):
    rows = json.loads(run_flops("ca_deit_tiny", "--img-size", "224", "--img-size", "320", "480", "--json"))
    assert rows[0] == {"model": "ca_deit_tiny", "img_size": [224, 224], "params": 6_140_200, "flops": rows[0]["flops"]}
    assert rows[1]["img_size"] == [320, 480] and rows[1]["flops"] > rows[0]["flops"]
    assert "GFLOPs" in run_flops("resnet18")


def test_circulant_cost_grows_n_log_n(run_flops):
    """Doubling the side quadruples N: CA-DeiT grows ~4x, softmax DeiT far faster (N^2 attention)."""
    rows = json.loads(
        run_flops("ca_deit_tiny", "deit_tiny_patch16_224", "--img-size", "512", "--img-size", "1024", "--json")
    )
    ca = rows[1]["flops"] / rows[0]["flops"]
    softmax = rows[3]["flops"] / rows[2]["flops"]
    assert 3.9 < ca < 4.6 and softmax > 8


def test_table5_ablation_rows_within_tolerance(run_flops):
    rows = json.loads(run_flops("--table", "5", "--json"))
    assert [r["paper"]["top1"] for r in rows] == [79.8, 79.7, 80.2, 80.9, 81.0, 80.0]
    for r in rows:
        for ours, paper in ((r["ours_params_m"], r["params_m"]), (r["ours_gflops"], r["gflops"])):
            assert abs(ours - paper) / paper <= 0.05, (r["label"], ours, paper)
    # The gate adds a C x C linear per block; circulant attention at head dim 64 or 1 costs less than softmax.
    deit, ca64, ca1, pre, post, deit_gated = rows
    assert ca64["ours_gflops"] < deit["ours_gflops"] and ca1["ours_gflops"] < deit["ours_gflops"]
    assert pre["ours_params_m"] == post["ours_params_m"] > ca1["ours_params_m"]
    assert deit_gated["ours_gflops"] > deit["ours_gflops"]


def _values(node):
    if isinstance(node, dict):
        for value in node.values():
            yield from _values(value)
    elif isinstance(node, list):
        for value in node:
            yield from _values(value)
    else:
        yield node


def test_paper_tables_hold_every_printed_number():
    assert available_tables() == [2, 3, 4, 5]
    counts = {2: 25, 3: 16, 4: 12, 5: 6}
    for number, count in counts.items():
        table = paper_table(number)
        assert len(table["rows"]) == count
        assert None not in list(_values(table)), f"table {number} has a null"
        for row in table["rows"]:
            assert row["gflops"] > 0 and (number == 3) != ("params_m" in row)  # Table 3 prints no params
            assert set(row.get("paper", {})) <= set(table["metrics"])
            assert all(isinstance(v, float) and math.isfinite(v) for v in row.get("paper", {}).values())
    # The paper's dashes (Swin-B's AP50/AP75) stay missing; every other Table 3 row has all six.
    table3 = {r["label"]: r["paper"] for r in paper_table(3)["rows"]}
    assert table3["Swin-B"] == {"AP_b": 46.9, "AP_m": 42.3}
    assert all(len(p) == 6 for label, p in table3.items() if label != "Swin-B")
    # Rows that are our targets (CAT, reconstructed) carry no paper metric.
    assert all(("paper" in r) != r.get("target", False) for r in paper_table(2)["rows"])


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (["0"], "argument --img-size: '0' is not a positive integer"),
        (["big"], "argument --img-size: 'big' is not a positive integer"),
        (["100"], "error: invalid config: ca_deit_tiny does not run at 100x100: expected images (B, C, H, W) with H"),
    ],
)
def test_a_size_the_model_cannot_take_is_one_line(run_tool, size, expected):
    err = run_tool("flops", "ca_deit_tiny", "--img-size", *size, expect=2, stderr=True)
    assert expected in err and "Traceback" not in err


def test_counting_leaves_a_training_model_as_it_was():
    """Counted in eval mode: BatchNorm's running statistics are not updated by the count, and every module is
    back in its own mode afterwards."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5)).train()
    model[2].eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert count_macs(model, torch.randn(2, 3, 8, 8) + 5) == 2 * 4 * 3 * 9 * 6 * 6
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [m.training for m in model] == [True, True, False]
