"""The analysis tools run end to end on CPU at small settings and write what they promise."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
from PIL import Image

from tests.conftest import REPO


def test_bccb_analysis(run_tool, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray(rng.integers(0, 255, (80, 96, 3), dtype=np.uint8)).save(images / f"{i}.png")
    out = tmp_path / "out"
    text = run_tool("bccb_analysis", "--out", str(out), "--images", str(images), "--img-size", "64")
    result = json.loads((out / "bccb.json").read_text())
    assert result["grid"] == [4, 4] and result["images"] == 2 and result["prefix_tokens"] == 1
    assert len(result["layers"]) == 12 and len(result["layers"][0]["heads"]) == 3
    for layer in result["layers"]:
        # Softmax maps of an untrained DeiT are near-uniform, hence far closer to BCCB than random matrices.
        assert layer["mean_distance"] < layer["mean_random_stochastic"]
        assert 0 <= layer["mean_distance_centred"] <= 1.0 + 1e-9
    for name in ("fig2_attention_maps", "fig3_neighbour_queries"):
        assert (out / f"{name}.png").stat().st_size > 0 and (out / f"{name}.pdf").is_file()
    assert "relative distance" in text


def test_bccb_analysis_default_images(run_tool, tmp_path):
    run_tool("bccb_analysis", "--out", str(tmp_path), "--img-size", "48", "--num-images", "1")
    assert json.loads((tmp_path / "bccb.json").read_text())["grid"] == [3, 3]


def test_visualize_kernels(run_tool, tmp_path):
    run_tool(
        "visualize_kernels",
        "--out",
        str(tmp_path),
        "--img-size",
        "64",
        "--channels",
        "4",
        "--model-arg",
        "depth=3",
        "--model-arg",
        "embed_dim=32",
    )
    result = json.loads((tmp_path / "kernels.json").read_text())
    assert len(result["layers"]) == 3
    for layer in result["layers"]:
        assert layer["grid"] == [4, 4]
        assert 0 < layer["mass_3x3"] <= layer["mass_7x7"] <= 1 + 1e-6  # weights are a distribution
    assert (tmp_path / "kernels.png").stat().st_size > 0 and (tmp_path / "kernels.pdf").is_file()


def test_benchmark(run_tool, tmp_path):
    text = run_tool("benchmark", "--out", str(tmp_path), "--res", "32", "48", "--iters", "2", "--warmup", "1")
    with open(tmp_path / "benchmark.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["model"], r["res"]) for r in rows] == [
        ("deit_tiny_patch16_224", "32"),
        ("ca_deit_tiny", "32"),
        ("deit_tiny_patch16_224", "48"),
        ("ca_deit_tiny", "48"),
    ]
    for r in rows:
        assert float(r["fwd_img_s"]) > 0 and float(r["fwd_bwd_img_s"]) > 0 and float(r["peak_rss_mib"]) > 50
        assert float(r["fwd_img_s_p25"]) <= float(r["fwd_img_s"]) <= float(r["fwd_img_s_p75"])
    assert (tmp_path / "fig4_efficiency.png").stat().st_size > 0
    assert "forward speed-up of ca_deit_tiny" in text


def test_make_tables_fills_a_row_from_a_real_run(run_tool, tmp_path):
    """A (tiny) ImageNet-layout run of ca_deit_tiny at 224 fills the CA-DeiT-T row of Table 2."""
    for split in ("train", "val"):
        for c in range(2):
            folder = tmp_path / "imagenet" / split / f"n0000{c}"
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (64, 64), (80 * c, 40 * i, 100)).save(folder / f"{i}.png")
    run_dir = tmp_path / "runs" / "ca_deit_t"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "train_cls.py"),
            "experiment=ca_deit_t",
            f"data.root={tmp_path / 'imagenet'}",
            "data.num_classes=2",
            "epochs=1",
            "batch_size=4",
            "++model.kwargs={embed_dim:16,depth:1}",
            "aug.mixup=0",
            "aug.cutmix=0",
            "workers=0",
            "logger.wandb.mode=disabled",
            f"output_dir={run_dir}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out_md = tmp_path / "tables.md"
    text = run_tool("make_tables", str(tmp_path / "runs"), "--table", "2", "--out", str(out_md))
    top1 = json.loads((run_dir / "metrics.json").read_text())["best_top1"]
    row = next(line for line in text.splitlines() if line.startswith("| CA-DeiT-T |"))
    assert f"| {top1:.2f} |" in row and str(run_dir) in row
    assert "| DeiT-T |" in text and "not run" in text.split("| DeiT-T |")[1].splitlines()[0]
    assert out_md.read_text().startswith("### Table 2")
