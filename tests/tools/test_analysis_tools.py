"""The analysis tools run end to end on CPU at small settings and write what they promise."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import runpy
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from PIL import Image

from cat.classification.job import run
from tests import prewarmed
from tests.conftest import REPO, TINY_CLS, TINY_CONVERTED, compose_config


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


# Every picture the README and the documentation show: its file, the words its caption must hold (the weights it
# was made with), and for the ones a test can remake, the tool and arguments that make it and the numbers file it
# was made with (regenerated and compared).
FIGURES = {
    "docs/fig2_attention_maps.png": ("random weights", ("bccb_analysis",), "docs/fig2_attention_maps.json"),
    "docs/kernels.png": ("random weights", ("visualize_kernels",), "docs/kernels.json"),
    "docs/curves_demo.png": ("trained on digits from random initialisation", None, None),
    "docs/bench/fig4_efficiency.png": ("with random weights (speed does not depend on them)", None, None),
}


def _numbers(record) -> list[float]:
    """Every number of a tool's JSON record, in order (its layers' and heads' measures)."""
    if isinstance(record, dict):
        return [n for key in sorted(record) if key not in ("checkpoint",) for n in _numbers(record[key])]
    if isinstance(record, list):
        return [n for item in record for n in _numbers(item)]
    return [float(record)] if isinstance(record, (int, float)) and not isinstance(record, bool) else []


@pytest.mark.parametrize("picture", FIGURES)
def test_each_documented_picture_names_its_weights_and_its_numbers_regenerate(picture, run_tool, tmp_path):
    """The README's figure and every picture in docs/ say in their captions which weights made them (no trained
    softmax ViT can be downloaded here: the attention figures show random weights, and say so), and the ones made
    by a tool's defaults give the same numbers when the command is run again."""
    words, tool, numbers = FIGURES[picture]
    name = picture.removeprefix("docs/")
    captions = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for alt, target in re.findall(r"!\[([^\]]*)\]\(([^)]+)\)", page.read_text()):
            if (page.parent / target).resolve() == (REPO / picture).resolve():
                captions.append(alt)
    assert captions and all(words in alt for alt in captions), (picture, captions)
    assert (REPO / picture).stat().st_size > 0 and name
    if tool is None:
        return
    run_tool(*tool, "--out", str(tmp_path))
    made = json.loads(next(tmp_path.glob("*.json")).read_text())
    np.testing.assert_allclose(_numbers(made), _numbers(json.loads((REPO / numbers).read_text())), rtol=1e-4)


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


@pytest.mark.slow
def test_the_model_tools_take_a_training_runs_checkpoint(run_tool, tmp_path):
    """A converted DeiT trained by train_cls.py: its kernels (Fig. 5 of a plug-in model), its ONNX exports (both
    backends) at the one size a timm ViT is built for, and bccb_analysis's refusal of a model without softmax
    attention."""
    run(compose_config("cls", *TINY_CLS, *TINY_CONVERTED, "epochs=1", f"output_dir={tmp_path / 'run'}"))
    checkpoint = str(tmp_path / "run" / "best.pth")
    run_tool("visualize_kernels", "--checkpoint", checkpoint, "--out", str(tmp_path / "kernels"))
    result = json.loads((tmp_path / "kernels" / "kernels.json").read_text())
    assert result["model"] == "deit_tiny_patch16_224" and [layer["grid"] for layer in result["layers"]] == [[4, 4]]
    assert 0 < result["layers"][0]["mass_3x3"] <= 1 + 1e-6

    # Both backends take the class token's attention (an autograd Function) through torch.export.
    text = run_tool("export_onnx", "--backend", "matmul", "--checkpoint", checkpoint, "--out", str(tmp_path / "m.onnx"))
    assert float(text.splitlines()[-1].split("32x32 ")[1]) < 1e-4
    ops = {node.op_type for node in onnx.load(str(tmp_path / "m.onnx")).graph.node}
    assert "MatMul" in ops and "DFT" not in ops
    text = run_tool("export_onnx", "--checkpoint", checkpoint, "--out", str(tmp_path / "model.onnx"))
    assert text.startswith("deit_tiny_patch16_224 takes 32x32 only (--model-arg dynamic_img_size=true"), text
    assert float(text.splitlines()[-1].split("32x32 ")[1]) < 1e-4  # its one size, the only one checked

    err = run_tool("bccb_analysis", "--checkpoint", checkpoint, "--out", str(tmp_path / "bccb"), expect=2, stderr=True)
    assert err.strip().endswith("has no timm softmax Attention layers to analyse (a circulant model's kernels: "
                                "tools/visualize_kernels.py)") and "Traceback" not in err  # fmt: skip
    err = run_tool("visualize_kernels", "--model", "deit_tiny_patch16_224", "--out", str(tmp_path / "k"), expect=2,
                   stderr=True)  # fmt: skip
    assert "VisionTransformer has no circulant-attention layers" in err and "Traceback" not in err
    assert not (tmp_path / "bccb").exists() and not (tmp_path / "k").exists()


@pytest.mark.parametrize("tool", ["bccb_analysis", "visualize_kernels", "export_onnx"])
def test_a_size_the_model_cannot_take_is_one_line(run_tool, tool, tmp_path):
    out = tmp_path / ("model.onnx" if tool == "export_onnx" else "out")
    err = run_tool(tool, "--out", str(out), "--img-size", "0", expect=2, stderr=True)
    assert "argument --img-size: '0' is not a positive integer" in err
    if tool != "bccb_analysis":  # timm's ViT (its model) floors the patch grid of any size
        err = run_tool(tool, "--out", str(out), "--model", "ca_deit_tiny", "--img-size", "100", expect=2, stderr=True)
        assert "error: invalid config: ca_deit_tiny does not run at 100x100: expected images" in err, err
        assert "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    "tool, args, message",
    [
        ("benchmark", ["--rounds", "0"], "argument --rounds: '0' is not an integer from 1 to 1000"),
        ("benchmark", ["--res", "-1"], "argument --res: '-1' is not an integer from 32 to 4096"),
        ("benchmark", ["--res", "100000"], "argument --res: '100000' is not an integer from 32 to 4096"),
        ("benchmark", ["--families-res", "1"], "argument --families-res: '1' is not an integer from 32 to 4096"),
        ("benchmark", ["--min-block", "inf"], "argument --min-block: 'inf' is not a number above 0 and at most 10"),
        ("benchmark", ["--min-block", "nan"], "argument --min-block: 'nan' is not a number above 0 and at most 10"),
        ("benchmark", ["--min-block", "1e9"], "argument --min-block: '1e9' is not a number above 0 and at most 10"),
        ("benchmark", ["--device", "tpu"], "argument --device: 'tpu' is not cpu, cuda or cuda:N"),
        ("bench_attention", ["--train-res", "0"], "argument --train-res: '0' is not a positive integer"),
        ("bench_attention", ["--device", "cuda:x"], "argument --device: 'cuda:x' is not cpu, cuda or cuda:N"),
        (
            "bench_attention",
            ["--train-res", "100", "--train-models", "ca_deit_tiny"],
            "error: invalid config: ca_deit_tiny does not run at 100x100: expected images",
        ),
        (
            "bench_attention",
            ["--train-res", "224", "--train-models", "ca_deit_tiny+fast"],
            "error: invalid config: unknown model variant +fast in 'ca_deit_tiny+fast' (known: lean,",
        ),
        (
            "bench_data",
            ["--images", "5", "--classes", "2"],
            "--images 5: at least 704 (--world 2 ranks x (--batches 10 + 1 warm-up) x --batch 32",
        ),
        ("bccb_analysis", ["--num-images", "0"], "argument --num-images: '0' is not a positive integer"),
        (
            "flops",
            ["--det", "mask_rcnn_ca_pvt"],
            "argument --det: invalid choice: 'mask_rcnn_ca_pvt' (choose from 'mask",
        ),
        ("recipe_memory", ["--batches", "8", "8"], "--batches 8 8: two different batches"),
        ("make_toy_coco", ["OUT", "--train", "0"], "argument --train: '0' is not a positive integer"),
        ("make_toy_ade", ["OUT", "--train", "-1"], "argument --train: '-1' is not a positive integer"),
        ("recipe_memory", ["--models", "ca_deit_tiy"], "--models ca_deit_tiy: not in Table 2 (its models: deit_tiny"),
    ],
)
def test_the_benchmarks_refuse_what_they_cannot_measure_in_one_line(run_tool, tool, args, message, tmp_path):
    """Before anything is built or timed (each of these was a traceback, some after minutes of other timings)."""
    out = str(tmp_path / "out")
    args = [out if arg == "OUT" else arg for arg in args]  # the toy-data tools' folder
    err = run_tool(
        tool, *(["--out", out] if tool in ("benchmark", "bccb_analysis") else []), *args, expect=2, stderr=True
    )
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_the_benchmark_writes_only_its_own_files_in_a_folder_it_can_make(run_tool, tmp_path):
    """--out a file, a path under a file or a place that cannot be written: one line before anything is measured;
    a link (or FIFO) planted at one of its file names in the folder: refused, its target untouched."""
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    for out, expected in (
        (a_file, "a file stands at it or on the way to it"),
        (a_file / "x", "a file stands at it or on the way to it"),
        (Path("/proc/x"), "cannot make the folder"),
    ):
        err = run_tool("benchmark", "--out", str(out), "--res", "32", expect=2, stderr=True)
        assert f"error: --out {out}: {expected}" in err and "Traceback" not in err, err
    assert a_file.read_text() == "mine"
    for name in ("benchmark.json", "fig4_efficiency.png"):
        out = tmp_path / name.split(".")[0]
        out.mkdir()
        target = tmp_path / f"target_of_{name}"
        target.write_text("the user's")
        (out / name).symlink_to(target)
        err = run_tool("benchmark", "--out", str(out), "--res", "32", "--no-families", expect=2, stderr=True)
        assert f"{out / name} is a symbolic link, not a regular file" in err and "Traceback" not in err, err
        assert target.read_text() == "the user's" and (out / name).is_symlink()


def test_a_missing_gpu_is_named():
    from cat.toolkit import device_name

    if torch.cuda.is_available():
        assert device_name("cuda") == "cuda" and device_name("cuda:0") == "cuda:0"
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="cuda: CUDA is not available on this machine"):
            device_name("cuda")
    assert device_name("cpu") == "cpu"


@pytest.mark.slow
def test_benchmark_measures_fig4(run_tool, tmp_path):
    """tools/benchmark.py, the paper's Fig. 4: (a, b) CA-DeiT-T against DeiT-T with SDPA and with matmul softmax
    over resolutions, interleaved in one process, with each training step's kernels and tensor memory; (c, d) the
    families' throughput against the paper's top-1 (here the tiny ones: the S and B rows are the same code, and
    their 22M and 86M parameters were half the test's time)."""
    args = (
        "--out",
        str(tmp_path),
        "--res",
        "32",
        "48",
        "--rounds",
        "1",
        "--min-block",
        "0.001",
        "--families-res",
        "32",
        "--families",
        "CA-DeiT-T",
        "DeiT-T",
    )
    text = run_tool("benchmark", *args)
    result = json.loads((tmp_path / "benchmark.json").read_text())
    assert result["resolutions"] == [32, 48] and list(result["speed"]) == ["fp32"]
    for res in ("32", "48"):
        rows = result["speed"]["fp32"][res]
        assert list(rows) == ["CA-DeiT-T", "DeiT-T (SDPA)", "DeiT-T (matmul)"]
        for row in rows.values():
            assert row["batch"] == 8 and row["infer_img_s"] > 0 and row["train_step_ms"] > 0
            assert row["train_kernels"] > 100 and row["train_peak_mib"] > 0
        # The same softmax attention written two ways: more kernels for the matmul form, not fewer.
        assert rows["DeiT-T (matmul)"]["train_kernels"] > rows["DeiT-T (SDPA)"]["train_kernels"]
    assert result["gflops"]["DeiT-T (matmul)"] == result["gflops"]["DeiT-T (SDPA)"]
    assert [r["label"] for r in result["families"]] == ["CA-DeiT-T", "DeiT-T"]
    assert [r["top1"] for r in result["families"]] == [75.0, 72.2]  # the paper's Table 2
    assert (tmp_path / "fig4_efficiency.png").stat().st_size > 0
    assert "CA-DeiT-T against SDPA / matmul softmax" in text
    # The host's cost of a step: CPU time at 32^2, batch 1, one thread, both models, fp32 and bf16, the ratio the
    # median of paired blocks' (so near, not equal to, the ratio of the medians).
    for dtype in ("fp32", "bf16"):
        row = result["host_cost"][dtype]
        assert 0 < row["ratio_q1"] <= row["ratio"] <= row["ratio_q3"] and row["DeiT-T (SDPA) ms"] > 0
        assert row["ratio"] == pytest.approx(row["CA-DeiT-T ms"] / row["DeiT-T (SDPA) ms"], rel=0.5)
        assert f"host cost of a training step at 32², batch 1, one thread, {dtype}: CA-DeiT-T" in text


def _train_cls(*overrides: str) -> None:
    proc = prewarmed.run(
        [sys.executable, str(REPO / "train_cls.py"), *overrides, "workers=0", "logger.wandb.mode=disabled"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def _row(text: str, label: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.mark.slow
def test_make_tables_fills_rows_from_real_runs(run_tool, tmp_path):
    """A (tiny) ImageNet-layout training run of ca_deit_tiny at 224, and an eval run of its checkpoint,
    each fill the CA-DeiT-T row of Table 2 with the paper's top-1 beside ours; a CA-DeiT-S run with
    reweight=pre fills Table 5's pre-reweighting row and no other."""
    for split in ("train", "val"):
        for c in range(2):
            folder = tmp_path / "imagenet" / split / f"n0000{c}"
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (64, 64), (80 * c, 40 * i, 100)).save(folder / f"{i}.png")
    common = [f"data.root={tmp_path / 'imagenet'}", "data.num_classes=2", "batch_size=4", "aug.mixup=0", "aug.cutmix=0"]
    run_dir = tmp_path / "runs" / "ca_deit_t"
    fast = ["data.decode_draft=true", "data.normalize_on_device=true"]  # the opt-in loading path, end to end
    _train_cls(
        "experiment=ca_deit_t",
        *common,
        *fast,
        "epochs=1",
        "++model.kwargs={embed_dim:16,depth:1}",
        f"output_dir={run_dir}",
    )
    out_md = tmp_path / "tables.md"
    text = run_tool("make_tables", str(tmp_path / "runs"), "--table", "2", "--out", str(out_md))
    top1 = json.loads((run_dir / "metrics.json").read_text())["val/best_top1"]
    assert _row(text, "CA-DeiT-T")[3:6] == [f"{top1:.2f}", "75.0", f"`{run_dir}`"]
    assert _row(text, "DeiT-T")[3:] == ["—", "72.2", "not run"]
    assert out_md.read_text().startswith("### Table 2")
    # Its learning curves, with the paper's top-1 for CA-DeiT-T as a line.
    run_tool("plot_runs", str(run_dir), "--out", str(tmp_path / "curves.svg"))
    svg = (tmp_path / "curves.svg").read_text()
    assert all(text in svg for text in ("ca_deit_t", "paper 75.0", "val top-1 (%)", "train loss", "learning rate"))
    # The run a folder was started over from (resume=false) is not that folder's result, even with the better
    # top-1; asked for by its own folder, it is a run.
    earlier = run_dir / "earlier_runs" / "20261201-000000"
    earlier.mkdir(parents=True)
    (earlier / "config.yaml").write_bytes((run_dir / "config.yaml").read_bytes())
    (earlier / "metrics.json").write_text(json.dumps({"top1": 99.5, "best_top1": 99.5}))
    assert _row(run_tool("make_tables", str(tmp_path / "runs"), "--table", "2"), "CA-DeiT-T")[3] == f"{top1:.2f}"
    assert _row(run_tool("make_tables", str(earlier), "--table", "2"), "CA-DeiT-T")[3] == "99.50"

    eval_dir = tmp_path / "evals" / "ca_deit_t"
    _train_cls(
        "experiment=ca_deit_t",
        *common,
        "mode=eval",
        f"checkpoint={run_dir / 'best.pth'}",
        "++model.kwargs={embed_dim:16,depth:1}",
        f"output_dir={eval_dir}",
    )
    text = run_tool("make_tables", str(tmp_path / "evals"), "--table", "2")
    top1 = json.loads((eval_dir / "eval" / "metrics.json").read_text())["eval/top1"]
    assert _row(text, "CA-DeiT-T")[3:6] == [f"{top1:.2f}", "75.0", f"`{eval_dir / 'eval'}`"]

    ablation_dir = tmp_path / "ablation" / "pre"
    _train_cls(
        "experiment=table5_ca_pre",
        *common,
        "epochs=1",
        "++model.kwargs.embed_dim=16",
        "++model.kwargs.depth=1",
        f"output_dir={ablation_dir}",
    )
    text = run_tool("make_tables", str(tmp_path / "ablation"), "--table", "5")
    filled = [
        label
        for label in ("+ token pre-reweighting", "+ token post-reweighting (CA-DeiT-S)", "+ head dim d=1")
        if _row(text, label)[-1] != "not run"
    ]
    assert filled == ["+ token pre-reweighting"] and _row(text, "+ token pre-reweighting")[4] == "80.9"


def test_make_tables_on_an_empty_folder_lists_every_row_as_not_run(run_tool, tmp_path):
    from cat.paper import available_tables, paper_table

    text = run_tool("make_tables", str(tmp_path))
    for number in available_tables():
        assert f"### Table {number}:" in text
        for row in paper_table(number)["rows"]:
            assert _row(text, row["label"])[-1] == "not run"
    assert "0 runs found" in text


@pytest.mark.slow
def test_make_tables_refuses_broken_and_hostile_run_files(run_tool, tmp_path):
    """A sweep's or run's files that do not parse, hold the wrong thing, ask for absurd work or try
    to run code (a YAML python tag) end the tool with one line naming the file; nothing runs."""
    marker = tmp_path / "MARKER"
    deep = "[" * 50_000 + "]" * 50_000
    cases = {  # case: (file, its text, what the error line says)
        "yaml_tag": ("multirun.yaml", f"!!python/object/apply:os.system ['touch {marker}']\n", "not valid YAML"),
        "huge_sweep": (
            "multirun.yaml",
            "hydra: {overrides: {task: ['seed=range(0,100000)', 'lr=range(0,100000)']}, "
            "job: {config: {override_dirname: {}}}}\n",
            "asks for 10,000,000,000 cells (seed: 100000 x lr: 100000)",
        ),
        "foreign_job": (  # the interpolation a trainer's config records, naming a job that is no cat trainer's
            "multirun.yaml",
            "hydra: {overrides: {task: [seed=0]}, job: {name: os.system, config: {override_dirname: "
            "{exclude_keys: '${cat_unnamed_keys:os.system}'}}}}\n",
            "hydra.job.name='os.system' is not a cat trainer's job",
        ),
        "config_unclosed": ("config.yaml", "model: [unclosed\n", "not valid YAML"),
        "config_model_string": ("config.yaml", "model: ca_deit_tiny\n", "'model' is a str, not a mapping"),
        "config_deep": ("config.yaml", f"model: {deep}\n", "nested too deeply"),
        "overrides_mapping": ("overrides.yaml", "{not: a list}\n", "does not hold a list"),
        "overrides_mixed": ("overrides.yaml", "[1, {a: 2}]\n", "holds no Hydra overrides of one cell"),
        "metrics_python": ("metrics.json", "{'top1': 1}", "not valid JSON"),
        "metrics_string": ("metrics.json", '{"top1": "high"}', "top1 is 'high', not a number"),
        "metrics_nan": ("metrics.json", '{"top1": NaN}', "top1 is nan, not a finite number"),  # was an AttributeError
        "metrics_infinity": ("metrics.json", '{"val/top1": -Infinity}', "val/top1 is -inf, not a finite number"),
        "metrics_deep": ("metrics.json", deep, "nested too deeply"),
    }
    good_multirun = "hydra: {overrides: {task: [seed=0]}, job: {config: {override_dirname: {}}}}\n"
    for case, (name, text, expected) in cases.items():
        sweep = tmp_path / case
        cell = sweep / "cell"
        cell.mkdir(parents=True)
        (sweep / "multirun.yaml").write_text(text if name == "multirun.yaml" else good_multirun)
        (cell / "overrides.yaml").write_text(text if name == "overrides.yaml" else "[seed=0]\n")
        if name in ("config.yaml", "metrics.json"):
            (cell / name).write_text(text)
            (cell / ({"config.yaml": "metrics.json", "metrics.json": "config.yaml"}[name])).write_text("{}")
        stderr = run_tool("make_tables", str(sweep), expect=2, stderr=True)
        broken = sweep / name if name == "multirun.yaml" else cell / name
        assert "Traceback" not in stderr, (case, stderr[-2000:])
        (line,) = [x for x in stderr.splitlines() if x.startswith("error:")]
        assert str(broken) in line and expected in line, (case, line)
    assert not marker.exists()


def _one_cell_sweep(sweep: Path) -> Path:
    """A sweep folder with one cell (seed=0) and nothing run in it yet: the cell's folder."""
    cell = sweep / "cell"
    cell.mkdir(parents=True)
    (sweep / "multirun.yaml").write_text(
        "hydra: {overrides: {task: [seed=0]}, job: {config: {override_dirname: {}}}}\n"
    )
    (cell / "overrides.yaml").write_text("[seed=0]\n")
    return cell


def test_plot_runs_draws_a_sweeps_seeds_as_a_band_and_refuses_what_is_no_run(run_tool, tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text(
        "hydra: {overrides: {task: ['seed=0,1', 'lr=0.1,0.2']}, job: {config: {override_dirname: {}}}}\n"
    )
    for seed in (0, 1):
        for lr in (0.1, 0.2):
            cell = sweep / f"lr={lr},seed={seed}"
            cell.mkdir()
            (cell / "overrides.yaml").write_text(f"[seed={seed}, lr={lr}]\n")
            rows = [{"step": 5, "train/loss_step": 9.0, "train/epoch_eta_s": 1.0}]  # an interval row: not an epoch's
            rows += [
                {"step": 10 * e, "epoch": e, "train/loss": 2 / e + seed, "train/lr": lr, "val/top1": 10 * e + seed}
                for e in (1, 2, 3)
            ]
            (cell / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_tool("plot_runs", str(sweep), "--out", str(tmp_path / "sweep.svg"))
    svg = (tmp_path / "sweep.svg").read_text()
    assert "sweep: lr=0.1 (2 seeds)" in svg and "sweep: lr=0.2 (2 seeds)" in svg and "paper" not in svg
    plot_runs = runpy.run_path(str(REPO / "tools" / "plot_runs.py"))
    values = [plot_runs["epoch_values"](sweep / f"lr=0.1,seed={seed}")["val/top1"] for seed in (0, 1)]
    assert plot_runs["mean_band"](values) == ([1, 2, 3], [10.5, 20.5, 30.5], [0.5**0.5] * 3)
    err = run_tool("plot_runs", str(tmp_path), "--out", str(tmp_path / "x.png"), expect=2, stderr=True)
    assert f"{tmp_path}: neither a run (metrics.jsonl) nor a sweep (multirun.yaml) folder" in err
    err = run_tool("plot_runs", str(sweep), "--out", str(tmp_path / "x.pdf"), expect=2, stderr=True)
    assert "expected a .png or .svg file" in err


def _run_rows(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_plot_runs_ends_every_hostile_input_in_one_line_or_a_picture(run_tool, tmp_path):
    """Each passed its checks and ended in a traceback: a run with no epoch row yet, a name with mathtext, an epoch
    at -2**70, values at inf or 1e308, a sweep whose multirun.yaml holds a range, --out a folder or unwritable."""
    good = [{"step": 1, "epoch": 1, "train/loss": 1.0, "val/top1": 50.0, "train/lr": 1e-3}]
    _run_rows(tmp_path / "steps_only", [{"step": 5, "train/loss_step": 2.0}])
    err = run_tool("plot_runs", str(tmp_path / "steps_only"), "--out", str(tmp_path / "a.png"), expect=2, stderr=True)
    assert "no run has an epoch's row in its metrics.jsonl yet" in err and "Traceback" not in err
    odd = [
        {"step": 2, "epoch": -(2**70), "train/loss": 1.0},
        {"step": 3, "epoch": 2, "train/loss": float("inf"), "val/top1": 1e308},
        {"step": 4, "epoch": 3, "train/loss": -1e308, "val/top1": 60.0},
    ]
    _run_rows(tmp_path / "run_$x^2$_{", good + odd)
    run_tool("plot_runs", str(tmp_path / "run_$x^2$_{"), "--out", str(tmp_path / "odd.svg"))
    assert "run_$x^2$_{" in (tmp_path / "odd.svg").read_text()
    sweep = tmp_path / "ranged"
    cell = _run_rows(sweep / "seed=0", good)
    (cell / "overrides.yaml").write_text("[seed=0]\n")
    (sweep / "multirun.yaml").write_text(
        "hydra: {overrides: {task: ['seed=range(0,2)']}, job: {config: {override_dirname: {}}}}\n"
    )
    assert "1 curve(s)" in run_tool("plot_runs", str(sweep), "--out", str(tmp_path / "r.png"))
    # A range a sweep could never have run (a step of 0, a bound at infinity or NaN): one line naming it.
    for bad in ("range(0,10,0)", "range(0,inf)", "range(0,nan)"):
        (sweep / "multirun.yaml").write_text(
            f"hydra: {{overrides: {{task: ['seed={bad}']}}, job: {{config: {{override_dirname: {{}}}}}}}}\n"
        )
        err = run_tool("plot_runs", str(sweep), "--out", str(tmp_path / "r.png"), expect=2, stderr=True)
        assert f"seed={bad}: a range needs a finite start and stop and a step other than 0" in err, err
        assert "Traceback" not in err
    # Epochs without validation (val/top1): the picture, with its legend from the panels that have lines.
    _run_rows(tmp_path / "no_val", [{"step": 1, "epoch": 1, "train/loss": 1.0, "train/lr": 1e-3}])
    assert "1 curve(s)" in run_tool("plot_runs", str(tmp_path / "no_val"), "--out", str(tmp_path / "nv.png"))
    (tmp_path / "a_folder.png").mkdir()
    for out, problem in ((tmp_path / "a_folder.png", "a folder"), (Path("/proc/cat.png"), "cannot be written")):
        err = run_tool("plot_runs", str(tmp_path / "run_$x^2$_{"), "--out", str(out), expect=2, stderr=True)
        assert f"--out {out}: {problem}" in err and "Traceback" not in err
    # Folders the OS will not look at: a name over its 255 bytes (and a link only its owner may follow, where
    # this user is not its owner): one line each, not an OSError's traceback.
    long_name = str(tmp_path / ("a" * 300))
    err = run_tool("plot_runs", long_name, "--out", str(tmp_path / "l.png"), expect=2, stderr=True)
    assert "cannot be read (File name too long)" in err and "Traceback" not in err
    try:
        os.readlink("/proc/1/cwd")
    except PermissionError:
        err = run_tool("plot_runs", "/proc/1/cwd", "--out", str(tmp_path / "p.png"), expect=2, stderr=True)
        assert "/proc/1/cwd: cannot be read (Permission denied)" in err


def test_make_tables_counts_a_cell_with_a_foreign_lock_as_failed(run_tool, tmp_path):
    cell = _one_cell_sweep(tmp_path)
    (cell / ".lock").write_text("[]")
    assert "1 failed" in run_tool("make_tables", str(tmp_path))
    # A log that ends in a long line of table cells, control characters and bytes that are not UTF-8: one row,
    # its cell quoted as text and cut short.
    (cell / "log.txt").write_bytes(b"[2026-12-02 10:00:00] started\n" + b"a|b\x1b[2J\r\xff" * 100_000 + b"\n\n")
    (row,) = [line for line in run_tool("make_tables", str(tmp_path)).splitlines() if "1 failed" in line]
    quoted = row.partition("(failed, its log ends: ")[2].removesuffix(") |")
    assert len(quoted) == 160 and quoted.endswith("…") and "a\\|b [2J \ufffda\\|b" in quoted, row


@pytest.mark.slow
def test_make_tables_says_how_a_failed_cell_ended(run_tool, tmp_path):
    """A real sweep whose cell diverges: the table gives the error its run's log.txt ends with."""
    proc = prewarmed.run(
        [
            sys.executable,
            "train_cls.py",
            "-m",
            *TINY_CLS,
            "lr=1e6",
            "schedule.warmup_epochs=0",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    (row,) = [line for line in run_tool("make_tables", str(tmp_path)).splitlines() if "lr=1000000.0" in line]
    status = row.strip("|").split("|")[-1].strip()
    assert status.startswith("1 failed (failed, its log ends: error: ") and "non-finite" in status, status


@pytest.mark.slow
def test_make_tables_reads_a_hostile_history_safely(run_tool, tmp_path):
    """A stopped cell's metrics.jsonl with junk in it: only real entries count, nothing raises; a
    history that cannot be read at all is one line naming it."""
    cell = _one_cell_sweep(tmp_path)
    (cell / "config.yaml").write_text("model: {name: ca_deit_tiny}\ndata: {name: digits}\n")
    (cell / "metrics.json").write_text('{"preempted": true, "epoch": 1}')
    lines = [
        '{"step": 5, "val/top1": 12.5}',
        "[1, 2, 3]",
        '{"step": true, "val/top1": 99.0}',
        '{"step": "9", "val/top1": 98.0}',
        "[" * 100_000 + "]" * 100_000,
        '{"step": 7, "train/loss": 1.0}',
    ]
    (cell / "metrics.jsonl").write_bytes("\n".join(lines).encode() + b"\n\xff\xfe{torn")
    assert "1 stopped (stopped at step 7, top1 12.50)" in run_tool("make_tables", str(tmp_path))
    (cell / "metrics.jsonl").unlink()
    (cell / "metrics.jsonl").mkdir()
    proc = prewarmed.run(
        [sys.executable, str(REPO / "tools" / "make_tables.py"), str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert str(cell / "metrics.jsonl") in line and "cannot be read" in line


@pytest.mark.slow  # the tool end to end
def test_bench_logging_reports_its_rows(run_tool):
    """tools/bench_logging.py, tiny: the A/B rows, the direct cost and the data share, each a number (their
    sizes are the benchmark's to report, not a test's)."""
    rows = json.loads(run_tool("bench_logging", "--rounds", "1", "--steps", "4", "--threads", "1", "--json"))
    assert [r["row"] for r in rows] == ["logging", "logging, direct", "profiler off", "data share"]
    assert rows[1]["cost_s"] > 0 and rows[0]["with_s"] > 0 and rows[2]["without_s"] > 0
    share = rows[3]
    assert 0 < share["implied_share"] < 1 and 0 <= share["reported_share"] <= 1


@pytest.mark.slow  # the tool end to end
def test_bench_data_measures_every_format(run_tool, tmp_path):
    """tools/bench_data.py on a tiny generated set: every format loads, the opens and cache sizes
    are what each layout claims (a folder opens every image, a zip reader one file per process, a
    tar stream its rank's shards, part holds 1/world of full)."""
    args = ["--images", "24", "--classes", "3", "--batch", "4", "--batches", "1", "--rounds", "1", "--world", "2"]
    args += ["--shard-mb", "0.2"]  # a few images per shard: rank 0 streams some of them
    rows = {r["format"]: r for r in json.loads(run_tool("bench_data", *args, "--data", str(tmp_path), "--json"))}
    assert set(rows) == set(runpy.run_path(str(REPO / "tools" / "bench_data.py"))["FORMATS"])  # every format
    assert all(r["images_per_s_per_worker"] > 0 for r in rows.values())
    assert rows["folder"]["files_opened_per_epoch"] == rows["folder"]["epoch_images"] == 24
    assert rows["folder/draft"]["files_opened_per_epoch"] == 24 and rows["zip/max-side"]["files_opened_per_epoch"] == 1
    resized = json.loads((tmp_path / "zip_max_side" / "manifest.json").read_text())
    assert resized["max_side"] == 256
    with (
        zipfile.ZipFile(tmp_path / "zip" / "train.zip") as full,
        zipfile.ZipFile(tmp_path / "zip_max_side" / "train.zip") as small,
    ):
        for name in full.namelist():
            before, after = (Image.open(io.BytesIO(z.read(name))).size for z in (full, small))
            assert max(after) == min(256, max(before)) and abs(after[0] / after[1] - before[0] / before[1]) < 0.02
    assert rows["timm"]["files_opened_per_epoch"] == 24
    assert rows["zip/no"]["files_opened_per_epoch"] == 1
    assert rows["zip/part"]["files_opened_per_epoch"] == rows["zip/full"]["files_opened_per_epoch"] == 0
    assert rows["zip/part"]["epoch_images"] == 12 and rows["zip/full"]["epoch_images"] == 24
    # tar: the rank opens each shard its half of the epoch touches once (issue 26 had 10 opens for 8 shards)
    assert rows["tar"]["epoch_images"] == 12 and rows["tar"]["files_opened_per_epoch"] == rows["tar"]["rank_shards"]
    assert 1 <= rows["tar"]["rank_shards"] < 6
    part, full = rows["zip/part"]["cache_mb_per_rank"], rows["zip/full"]["cache_mb_per_rank"]
    assert 0.3 * full < part < 0.7 * full and rows["folder"]["cache_mb_per_rank"] == 0


@pytest.mark.slow  # the tool end to end
def test_bench_index_measures_each_format_at_each_scale(run_tool, tmp_path):
    """tools/bench_index.py, tiny: a row per format and scale, an index file for cat's readers that grows with the
    split (none for torchvision's folder), workers measured, and a node extrapolated per format."""
    formats = ["folder", "zip/part", "torchvision"]
    args = ["--scale", "200", "400", "--classes", "4", "--world", "2", "--workers", "1", "--batch", "8", "--k", "2"]
    args += ["--shard-mb", "0.05", "--data", str(tmp_path), "--formats", *formats, "--json"]
    report = json.loads(run_tool("bench_index", *args, forked_workers=True))
    rows = {(r["format"], r["images"]): r for r in report["rows"]}
    assert set(rows) == {(f, n) for f in formats for n in (200, 400)}
    for fmt in ("folder", "zip/part"):
        assert rows[fmt, 400]["index_file_mb"] > rows[fmt, 200]["index_file_mb"] > 0
    assert rows["zip/part", 400]["cache_mb"] > 0 and rows["torchvision", 400]["index_file_mb"] == 0
    assert all(r["first_batch_s"] > 0 and r["worker_end_mb"] > 0 and r["epoch_batches"] > 2 for r in rows.values())
    assert [n["format"] for n in report["node"]] == formats and all(n["node_gb"] >= 0 for n in report["node"])


# A run folder as train_cls.py wrote it before each metric had one name (`top1`, `best_top1`, `val_loss`, ... in
# metrics.json; the checkpoints left out): made by the code of the commit before the rename (8638be8^), a tiny
# CA-DeiT-T on a 2-class ImageNet-layout folder, 2 epochs.
RUN_BEFORE_RENAME = Path(__file__).parent / "runs_before_rename" / "ca_deit_t"


def test_the_tools_read_a_run_written_before_the_metrics_were_renamed(run_tool, tmp_path):
    old = json.loads((RUN_BEFORE_RENAME / "metrics.json").read_text())
    assert "top1" in old and "val/top1" not in old  # the folder is what it says
    text = run_tool("make_tables", str(RUN_BEFORE_RENAME.parent), "--table", "2")
    assert _row(text, "CA-DeiT-T")[3:6] == [f"{old['best_top1']:.2f}", "75.0", f"`{RUN_BEFORE_RENAME}`"]
    run_tool("plot_runs", str(RUN_BEFORE_RENAME), "--out", str(tmp_path / "curves.svg"))
    assert "paper 75.0" in (tmp_path / "curves.svg").read_text()
    values = runpy.run_path(str(REPO / "tools" / "plot_runs.py"))["epoch_values"](RUN_BEFORE_RENAME)
    assert set(values["val/top1"]) == set(values["train/loss"]) == {1, 2}
    # As a sweep's cell: its seeds' mean is the old run's top-1.
    cell = _one_cell_sweep(tmp_path / "sweep")
    for name in ("metrics.json", "metrics.jsonl", "config.yaml"):
        (cell / name).write_bytes((RUN_BEFORE_RENAME / name).read_bytes())
    summary = run_tool("make_tables", str(tmp_path / "sweep"))
    assert f"{old['best_top1']:.2f}" in summary and "1 finished" in summary, summary


def test_predict_prints_the_models_top5_with_imagenets_names(run_tool, tmp_path):
    """tools/predict.py: the README's image -> prediction line, here with a checkpoint instead of the download: the
    classes printed are the model's own top-5 under timm's evaluation transform, named by ImageNet-1K's labels."""
    from timm.data import ImageNetInfo, create_transform, resolve_data_config

    import cat

    torch.manual_seed(0)
    model = cat.create_model("ca_deit_tiny", depth=2).eval()
    torch.save({"model": model.state_dict()}, tmp_path / "weights.pth")
    image = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 400, 3), dtype=np.uint8)).save(image)
    text = run_tool(
        "predict", str(image), "--model", "ca_deit_tiny", "--model-arg", "depth=2", "--checkpoint",
        str(tmp_path / "weights.pth"),
    )  # fmt: skip
    lines = text.strip().splitlines()
    batch = create_transform(**resolve_data_config({}, model=model))(Image.open(image).convert("RGB"))[None]
    with torch.no_grad():
        expected = model(batch).softmax(-1)[0].topk(5)
    names = ImageNetInfo()
    assert [line.split("%  ", 1)[1] for line in lines] == [names.index_to_description(i) for i in expected.indices]
    assert lines[0].startswith(f"1. {100 * expected.values[0].item():6.2f}%")


@pytest.mark.parametrize("content", [b"", b"\x89PNG\r\n\x1a\n" + b"\0" * 64, b"not an image at all"])
def test_predict_refuses_a_broken_image_in_one_line_naming_it(run_tool, tmp_path, content):
    image = tmp_path / "photo.png"
    image.write_bytes(content)
    err = run_tool("predict", str(image), "--model", "ca_deit_tiny", "--model-arg", "depth=1", expect=2, stderr=True)
    assert err.strip().splitlines()[-1].startswith(f"error: {image}: not a readable image"), err[-500:]
    assert image.read_bytes() == content


def _predicted(run_tool, *args: str) -> list[str]:
    return run_tool("predict", *args, "--model", "ca_deit_tiny", "--model-arg", "depth=1").strip().splitlines()


def test_predict_reads_16_bit_and_rotated_images_as_the_camera_meant_them(run_tool, tmp_path):
    """A 16-bit greyscale PNG classifies as its 8-bit scaling (not as white: a plain conversion clips 99.6% of its
    values), and a photo with an EXIF orientation as the photo turned upright."""
    rng = np.random.default_rng(0)
    grey16 = rng.integers(0, 65536, (224, 224), dtype=np.uint16)
    Image.fromarray(grey16).save(tmp_path / "deep.png")
    grey8 = np.rint(grey16 / 257.0).astype(np.uint8)
    Image.fromarray(np.repeat(grey8[..., None], 3, axis=-1)).save(tmp_path / "scaled.png")
    Image.fromarray(np.full((224, 224, 3), 255, np.uint8)).save(tmp_path / "white.png")
    assert _predicted(run_tool, str(tmp_path / "deep.png")) == _predicted(run_tool, str(tmp_path / "scaled.png"))
    assert _predicted(run_tool, str(tmp_path / "deep.png")) != _predicted(run_tool, str(tmp_path / "white.png"))
    upright = rng.integers(0, 255, (200, 300, 3), dtype=np.uint8)
    Image.fromarray(upright).save(tmp_path / "upright.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: the stored pixels are the upright photo turned 90 degrees counter-clockwise
    Image.fromarray(np.rot90(upright, 1).copy()).save(tmp_path / "turned.png", exif=exif)
    assert _predicted(run_tool, str(tmp_path / "turned.png")) == _predicted(run_tool, str(tmp_path / "upright.png"))


def test_predict_names_each_image_of_a_folder_and_refuses_an_empty_path(run_tool, tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    for seed, name in enumerate(("b.png", "a.png")):
        pixels = np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(photos / name)
    lines = _predicted(run_tool, str(photos))
    assert [line for line in lines if line.endswith(":")] == [f"{photos / 'a.png'}:", f"{photos / 'b.png'}:"]
    assert len(lines) == 12
    err = run_tool("predict", "", "--model", "ca_deit_tiny", expect=2, stderr=True)
    assert err.strip().splitlines()[-1] == (
        "error: the image path is empty (an unset variable?): name an image file or a folder of images"
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model", "resnet18", "--pretrained"], "--pretrained: the authors released weights for ca_deit_tiny, "),
        (["--model", "ca_pvt_tiny", "--pretrained"], "not ca_pvt_tiny; give weights with --checkpoint FILE"),
        (["--model-arg", "depth=!!python/object/apply:os.system ['id']"], "is not a plain YAML value"),
    ],
)
def test_predict_refuses_what_it_cannot_do_in_one_line(run_tool, tmp_path, args, expected):
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / "x.png")
    err = run_tool("predict", str(tmp_path / "x.png"), *args, expect=2, stderr=True)
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and expected in last, err[-800:]


def test_predict_builds_a_model_that_takes_no_input_size(run_tool, tmp_path):
    """A convolutional network (timm's resnet18, random weights) takes any size: no img_size is passed to it."""
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(tmp_path / "x.png")
    assert len(run_tool("predict", str(tmp_path / "x.png"), "--model", "resnet18").strip().splitlines()) == 5


def test_predict_refuses_a_decompression_bomb_in_one_line(run_tool, tmp_path):
    """A 30000 x 30000 PNG (3 MB, 2.7 GB decoded): refused before it is decoded."""
    import zlib

    width = height = 30000
    row = b"\0" + b"\0" * (3 * width)
    # A valid zlib stream of every row, without deflating 2.7 GB (7 CPU-seconds): one row deflated up to a full flush
    # is a run of blocks that needs no earlier bytes, so it repeats; then an empty final block and the data's Adler-32.
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    one_row = deflate.compress(row) + deflate.flush(zlib.Z_FULL_FLUSH)
    checksum = 1
    for _ in range(height):
        checksum = zlib.adler32(row, checksum)
    final = zlib.compressobj(9, zlib.DEFLATED, -15).flush()
    data = b"\x78\xda" + one_row * height + final + checksum.to_bytes(4, "big")
    assert zlib.decompressobj().decompress(data, 2**20) == (row * 12)[: 2**20]  # its first MiB: 11.6 rows

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return len(payload).to_bytes(4, "big") + kind + payload + zlib.crc32(kind + payload).to_bytes(4, "big")

    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")
    (tmp_path / "bomb.png").write_bytes(png)
    err = run_tool("predict", str(tmp_path / "bomb.png"), "--model", "ca_deit_tiny", expect=2, stderr=True)
    assert err.strip().splitlines()[-1].startswith(f"error: {tmp_path / 'bomb.png'}: too large to decode safely")
