"""ONNX export of CA-DeiT (ONNX DFT at any resolution, or the matmul DFT backend), and the attention
benchmark script."""

from __future__ import annotations

import json
import os

import onnx
import pytest

# Two of CA-DeiT-T's twelve blocks: every operator the export meets, at a sixth of the export time.
TWO_BLOCKS = ("--model-arg", "depth=2")


@pytest.mark.slow
def test_export_ca_deit_tiny_matmul(run_tool, tmp_path):
    path = tmp_path / "ca_deit_tiny.onnx"
    text = run_tool("export_onnx", "--backend", "matmul", "--out", str(path), "--img-size", "64", *TWO_BLOCKS)
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    ops = {node.op_type for node in model.graph.node}
    assert "MatMul" in ops and not any("FFT" in op or "DFT" in op for op in ops)
    assert {o.version for o in model.opset_import if o.domain == ""} == {18}
    assert float(text.split("64x64 ")[1].split()[0]) < 1e-4


@pytest.mark.slow
def test_export_dft_any_resolution(run_tool, tmp_path):
    path = tmp_path / "ca_deit_tiny.onnx"
    text = run_tool("export_onnx", "--out", str(path), "--img-size", "64", *TWO_BLOCKS)
    model = onnx.load(str(path))
    assert "DFT" in {node.op_type for node in model.graph.node}
    errors = [float(text.split(f"{size} ")[1].split(",")[0]) for size in ("64x64", "96x80")]
    assert max(errors) < 1e-4


def test_bench_attention_runs(run_tool):
    import json

    result = json.loads(
        run_tool(
            "bench_attention",
            "--grids",
            "6",
            "--batches",
            "1",
            "--backward",
            "--matmul",
            "--growth",
            "4",
            "6",
            "--rounds",
            "1",
            "--min-block",
            "0.001",
            "--json",
        )
    )
    for mode in ("forward", "forward_backward"):
        (row,) = result[mode]
        assert row["tokens"] == "6x6"
        assert all(row[f"{k}_ms"] > 0 for k in ("ours", "released", "sdpa", "gemm", "ours_matmul"))
    assert set(result["growth_exponent"]) == {"ours", "sdpa"}


@pytest.mark.slow
def test_bench_attention_memory_mode_measures_each_model_in_its_own_process(run_tool):
    import json

    result = json.loads(
        run_tool(
            "bench_attention",
            "--grids",
            "--memory-res",
            "256",
            "--memory-pairs",
            "ca_deit_tiny+lean:ca_deit_tiny+stored",
            "--json",
            forked_workers=True,
        )
    )
    (row,) = result["train_memory"]
    assert (row["model"], row["baseline"], row["resolution"], row["batch"]) == (
        "ca_deit_tiny+lean",
        "ca_deit_tiny+stored",
        256,
        1,
    )
    # The lean backward keeps far less than autograd through the same model (docs/perf.md).
    assert 0 < row["model_mib"] < row["baseline_mib"]
    assert row["ratio"] == row["model_mib"] / row["baseline_mib"]


def train_step_row(run_tool, models: list[str], *extra: str) -> dict:
    """The one row of bench_attention's training mode at 32^2, batch 2, for ``models`` (the first the baseline); the
    worker processes of ``--processes`` and ``--alone`` forked by the prewarmed server."""
    import json

    args = ["--grids", "--train-res", "32", "--train-batches", "2", "--train-models", *models, "--rounds", "1"]
    args += ["--min-block", "0.001", "--pairs", "3", *extra, "--json"]
    result = json.loads(run_tool("bench_attention", *args, forked_workers=True))
    (row,) = result["train_steps"]
    assert row[f"{models[0]}_paired"] == [1.0, 1.0, 1.0]
    return row


@pytest.mark.slow
def test_bench_attention_times_whole_training_steps(run_tool):
    models = ["deit_tiny_patch16_224", "ca_deit_tiny", "ca_deit_tiny+stored", "deit_tiny_patch16_224+converted"]
    row = train_step_row(run_tool, models)
    assert (row["resolution"], row["batch"], row[f"{models[0]}_speed"]) == (32, 2, 1.0)
    for name in models:
        assert row[f"{name}_ms"] > 0 and row[f"{name}_speed"] == row[f"{models[0]}_ms"] / row[f"{name}_ms"]
        median, q1, q3 = row[f"{name}_paired"]  # from single steps in pairs with the baseline
        assert 0 < q1 <= median <= q3


@pytest.mark.slow
def test_bench_attention_pools_paired_steps_over_fresh_processes(run_tool):
    """--processes: the pairs run in fresh worker processes (each laid out anew in memory) and are pooled."""
    models = ["deit_tiny_patch16_224", "ca_deit_tiny"]
    row = train_step_row(run_tool, models, "--processes", "2", "--model-arg", "depth=2")  # the workers' too
    median, q1, q3 = row[f"{models[1]}_paired"]
    by_process = row[f"{models[1]}_paired_by_process"]
    assert len(by_process) == 2 and all(m > 0 for m in by_process)
    assert q1 <= median <= q3 and min(by_process) - 1e-12 <= median <= max(by_process) + 1e-12


@pytest.mark.slow
def test_bench_attention_profiles_ops_and_times_each_model_alone_over_fresh_processes(run_tool):
    """--profile-ops: per operator, the converted model's self time against the native one's, pooled over the
    processes. --alone: each model's steps in processes of its own, the ratio of each round's medians."""
    import numpy as np

    models = ["ca_deit_tiny", "deit_tiny_patch16_224+converted"]
    row = train_step_row(run_tool, models, "--processes", "2", "--profile-ops", "1", "--alone", "2")
    ops = row[f"{models[1]}_ops"]
    assert [abs(op["diff_ms"]) for op in ops] == sorted((abs(op["diff_ms"]) for op in ops), reverse=True)
    (prefix,) = [op for op in ops if op["op"] == "_PrefixAttention"]  # the class token's node: converted only
    assert prefix["baseline_ms"] == 0 and prefix["ms"] == prefix["diff_ms"] > 0 and prefix["runs_above"] == 2
    base_ms, own_ms = (row[f"{name}_alone_ms_by_round"] for name in models)
    assert len(base_ms) == len(own_ms) == 2 and min(base_ms + own_ms) > 0
    assert row[f"{models[0]}_alone"] == [1.0, 1.0, 1.0]
    median, q1, q3 = row[f"{models[1]}_alone"]
    assert q1 <= median <= q3 and np.isclose(median, np.median(np.divide(base_ms, own_ms)))


@pytest.mark.parametrize(
    "args",
    [
        ["--pairs", "3", "--profile-ops", "2"],
        ["--pairs", "3", "--processes", "2", "--profile-ops", "-1"],
        ["--pairs", "3", "--processes", "2", "--profile-ops", "2", "--device", "cuda"],
        ["--pairs", "3", "--alone", "2"],
        ["--pairs", "3", "--processes", "2", "--alone", "-1"],
    ],
)
def test_bench_attention_refuses_profile_ops_or_alone_without_processes(run_tool, args):
    err = run_tool("bench_attention", "--grids", "--train-res", "32", *args, expect=2, stderr=True)
    flag = "--profile-ops" if "--profile-ops" in args else "--alone"
    assert f"{flag} " in err and "Traceback" not in err


@pytest.mark.parametrize("args", [["--processes", "2"], ["--processes", "-1", "--pairs", "3"]])
def test_bench_attention_refuses_processes_without_pairs_or_below_one(run_tool, args):
    err = run_tool("bench_attention", "--grids", "--train-res", "32", *args, expect=2, stderr=True)
    assert "--processes" in err and "Traceback" not in err


@pytest.mark.slow
def test_bench_attention_compiles_every_model_it_trains(run_tool):
    """--compile: each model's training steps through torch.compile, compiled before they are timed."""
    from torch._dynamo.utils import counters

    counters.clear()
    # At depth 1: a cold compile (a fresh machine's) takes 38 CPU-s, 51 at depth 2.
    row = train_step_row(run_tool, ["ca_deit_tiny"], "--compile", "--model-arg", "depth=1")
    assert counters["stats"]["unique_graphs"] >= 1 and row["ca_deit_tiny_ms"] > 0


def test_bench_attention_refuses_a_model_argument_its_models_do_not_take(run_tool):
    args = ["--grids", "--train-res", "32", "--train-models", "ca_deit_tiny", "--model-arg", "bogus=1"]
    err = run_tool("bench_attention", *args, expect=2, stderr=True)
    assert "ca_deit_tiny does not run at 32x32" in err and "'bogus'" in err and "Traceback" not in err


def test_bench_attention_compiles_training_steps_only(run_tool):
    err = run_tool("bench_attention", "--grids", "--compile", expect=2, stderr=True)
    assert "--compile applies to training steps: give --train-res" in err and "Traceback" not in err


def load_gpu_check():
    """tools/gpu_check.py as a module (it is a script, not a package's)."""
    import importlib.util

    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


@pytest.mark.parametrize("fft_backend", ["auto", "separable", "matmul"])
def test_gpu_check_correctness_dry_run_on_cpu(fft_backend):
    """The prepared GPU script's correctness part, run on the CPU (autocast there too), with each DFT backend: the
    separable GEMMs in half precision (bf16 keeps 8 bits) stay within gpu_check's tolerances against float32 FFTs,
    for the function, the module, its input gradient and a whole CA-DeiT-T. The dense DFT (matmul) leaves out
    56×56, where its 3136² half-precision GEMMs take a CPU 85 s; the same code is checked at the other grids."""
    gpu_check = load_gpu_check()
    grids = tuple(hw for hw in gpu_check.CORRECTNESS_GRIDS if fft_backend != "matmul" or hw != (56, 56))
    rows = gpu_check.correctness("cpu", fft_backend, grids)
    assert {r["dtype"] for r in rows} == {"fp16", "bf16"} and len(rows) == 6 * len(grids) + 2
    assert sum(r["what"] == "CirculantAttention grad" for r in rows) == 2 * len(grids)
    for r in rows:
        assert r["rel_err"] < r["tolerance"], r
    # Not vacuous: half precision moved every result off float32's.
    assert all(r["rel_err"] > 1e-5 for r in rows if r["what"] != "circulant_attention" or fft_backend != "auto")


def test_gpu_check_times_both_dfts_records_the_faster_and_keeps_its_budget_on_cpu(tmp_path, monkeypatch):
    """The speed part of the GPU script in small on the CPU: both DFTs timed under bf16 and fp16 and the faster
    recorded for the card, where fft_backend=auto then reads it; the speed rows against both baselines; a budget
    that has run out measures nothing more and names what it left out; Fig. 4's PNG from the rows."""
    import time

    from cat.ops import policy

    gpu_check = load_gpu_check()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(policy, "_measured", {})
    monkeypatch.setattr(gpu_check, "DFT_CASES", ((32, 2),))
    monkeypatch.setattr(gpu_check, "CASES", (("train", 32, 2), ("infer", 64, 1)))
    monkeypatch.setattr(gpu_check, "COMPILED_CASES", ())
    # The kernels through Triton's interpreter would take minutes here (tests/ops/test_kernels.py checks them).
    monkeypatch.setitem(gpu_check.MODELS, "CA-DeiT-T", "ca_deit_tiny+aten")
    choice = gpu_check.dft_choice("cpu", "cpu", 1)
    recorded = json.loads(policy.measured_choices_path().read_text())
    assert recorded == {"cpu": {"bfloat16": choice["bf16"]["choice"], "float16": choice["fp16"]["choice"]}}
    for dtype, row in choice.items():
        fft, separable = row["step_ms"]["32x2"]["fft"], row["step_ms"]["32x2"]["separable"]
        assert row["separable_over_fft"] == pytest.approx(separable / fft)
        assert row["choice"] == ("separable" if separable < fft else "fft")
        assert policy.measured_backend("cpu", str(gpu_check.AMP_DTYPES[dtype]).removeprefix("torch.")) == row["choice"]
    rows, skipped = gpu_check.speed("cpu", 1, time.monotonic() + 600)
    assert not skipped and [(r["what"], r["dtype"], r["mode"]) for r in rows] == [
        ("train", "fp32", "eager"),
        ("infer", "fp32", "eager"),
        ("train", "bf16", "eager"),
        ("infer", "bf16", "eager"),
    ]
    for r in rows:
        assert r["speed vs DeiT-T (SDPA)"] == pytest.approx(r["DeiT-T (SDPA) ms"] / r["CA-DeiT-T ms"])
        assert r["speed vs CA-DeiT-T (ATen)"] == pytest.approx(r["CA-DeiT-T (ATen) ms"] / r["CA-DeiT-T ms"])
    assert gpu_check.kernel_choice(rows, "cpu") is None  # no compiled training row: nothing recorded
    default_step = {"what": "train", "res": 224, "dtype": "bf16", "mode": "reduce-overhead"}
    for ratio, choice in ((1.3, "triton"), (0.8, "aten")):
        assert gpu_check.kernel_choice([default_step | {"speed vs CA-DeiT-T (ATen)": ratio}], "cpu")["choice"] == choice
        assert policy.measured_kernel("cpu") == choice  # what attention_kernel=auto reads for the card
    left_out = [f"{what} {res}^2 B={b} {dtype} eager" for dtype in ("fp32", "bf16") for what, res, b in gpu_check.CASES]
    assert gpu_check.speed("cpu", 1, time.monotonic() - 1) == ([], left_out)
    gpu_check.figure(rows, tmp_path, "cpu")
    assert (tmp_path / "fig4_efficiency.png").stat().st_size > 10_000


@pytest.mark.slow
def test_recipe_memory_estimates_a_row_from_two_measured_batches(run_tool):
    import json

    result = json.loads(
        run_tool(
            "recipe_memory",
            *("--models", "ca_deit_tiny", "--batches", "1", "2", "--recipe-batch", "4", "--json"),
            forked_workers=True,
        )
    )
    (row,) = result["rows"]
    assert (row["label"], row["img_size"], result["batches"]) == ("CA-DeiT-T", 224, [1, 2])
    fixed = 16 * row["params_m"] * 1e6 / 2**30 + 1.0  # the parameters' share and the default overhead
    assert row["gib_per_image"] > 0 and row["estimate_gib"] == pytest.approx(fixed + 4 * row["gib_per_image"])
    assert row["fits_40"] == row["fits_80"] == "as is"


@pytest.mark.parametrize("planted", ["link", "fifo"])
def test_gpu_check_refuses_what_is_planted_at_its_outputs_before_measuring(planted, tmp_path, capsys):
    """A link at --out/gpu_check.json is never written through, a FIFO never blocks: one line, exit 2, before the
    card is looked for."""
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("theirs")
    if planted == "link":
        (out / "gpu_check.json").symlink_to(victim)
    else:
        os.mkfifo(out / "gpu_check.json")
    with pytest.raises(SystemExit) as stop:
        load_gpu_check().main(["--out", str(out)])
    assert stop.value.code == 2 and victim.read_text() == "theirs"
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "gpu_check.json" in last
