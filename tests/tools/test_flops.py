"""tools/flops.py reproduces the paper's Table 2 (params and FLOPs) and counts any timm model."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def run_flops(run_tool):
    return lambda *args: run_tool("flops", *args)


def test_table2_within_tolerance(run_flops):
    rows = json.loads(run_flops("--table", "2", "--json"))
    assert len(rows) == 25
    for r in rows:
        for ours, paper in ((r["ours_params_m"], r["params_m"]), (r["ours_gflops"], r["gflops"])):
            if paper is not None:
                assert abs(ours - paper) / paper <= r["tolerance"], (r["label"], ours, paper)
        assert r["within_tolerance"]
    deit_t = next(r for r in rows if r["label"] == "DeiT-T")
    assert abs(deit_t["ours_gflops"] - deit_t["gflops"]) < 0.1
    markdown = run_flops("--table", "2")
    assert "| CA-PVT-T | `ca_pvt_tiny` | 224² | 12.2 | 12.2 |" in markdown


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
