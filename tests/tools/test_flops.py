"""tools/flops.py reproduces the paper's Table 2 FLOPs (and the released parameter counts)."""
from __future__ import annotations

import json
import runpy
import sys

import pytest

from tests.conftest import REPO

# Table 2 of the paper: GFLOPs at 224x224.
TABLE2_GFLOPS = {
    "ca_deit_tiny": 1.2, "ca_deit_small": 4.8, "ca_deit_base": 18.9,
    "deit_tiny_patch16_224": 1.2, "deit_small_patch16_224": 4.6, "deit_base_patch16_224": 17.6,
}


def run_flops(capsys, *args):
    argv = sys.argv
    sys.argv = ["flops.py", *args]
    try:
        with pytest.raises(SystemExit) as code:
            runpy.run_path(str(REPO / "tools" / "flops.py"), run_name="__main__")
    finally:
        sys.argv = argv
    assert code.value.code == 0
    return capsys.readouterr().out


def test_table2_flops(capsys):
    rows = json.loads(run_flops(capsys, *TABLE2_GFLOPS, "--json"))
    got = {r["model"]: r["flops"] / 1e9 for r in rows}
    for name, paper in TABLE2_GFLOPS.items():
        assert abs(got[name] - paper) / paper < 0.05, (name, got[name], paper)
    assert abs(got["deit_tiny_patch16_224"] - 1.2) < 0.1
    assert rows[0]["params"] == 6_140_200 and rows[0]["img_size"] == [224, 224]


def test_table_and_resolutions(capsys):
    out = run_flops(capsys, "ca_deit_tiny", "--img-size", "224", "--img-size", "320", "480")
    assert "224x224" in out and "320x480" in out and "GFLOPs" in out


def test_circulant_cost_grows_n_log_n(capsys):
    """Doubling the side quadruples N: CA-DeiT grows ~4x, softmax DeiT far faster (N^2 attention)."""
    rows = json.loads(run_flops(capsys, "ca_deit_tiny", "deit_tiny_patch16_224", "--img-size", "512",
                                "--img-size", "1024", "--json"))
    ca = rows[1]["flops"] / rows[0]["flops"]
    softmax = rows[3]["flops"] / rows[2]["flops"]
    assert 3.9 < ca < 4.6 and softmax > 8
