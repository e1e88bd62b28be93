"""What circulant attention's auto settings take per device and dtype (cat.ops.policy), and the line that says so."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from cat.ops import describe, policy
from cat.ops.policy import (
    AUTO_DEPTH,
    BUDGET_SHARE,
    backend_for,
    budget_bytes,
    default_budget_bytes,
    lean_for,
    measured_choices_path,
    record_measured_backend,
)

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture
def choices(tmp_path, monkeypatch):
    """An empty cache for the recorded DFT choices (what tools/gpu_check.py writes); none read before."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(policy, "_measured", {})
    return measured_choices_path()


@pytest.mark.parametrize(
    "device, dtype, expected",
    [
        # Until a card has measured the separable GEMMs: float32 cuFFT, the fewest operators and bytes per step.
        (CUDA, torch.bfloat16, "fft"),
        (CUDA, torch.float16, "fft"),
        (CUDA, torch.float32, "fft"),
        (CPU, torch.bfloat16, "fft"),  # GEMM DFTs measured slower on CPUs
        (CPU, torch.float32, "fft"),
    ],
)
def test_auto_dft_backend_by_device_and_dtype(device, dtype, expected, choices):
    assert backend_for("auto", device, dtype) == expected
    assert backend_for("matmul", device, dtype) == "matmul"  # a backend set is taken as set


def test_auto_takes_what_the_card_measured_under_half_precision(choices):
    """tools/gpu_check.py records the faster DFT per card and dtype; auto takes it there and only there (a CPU, float32
    and the other dtype keep fft). Without a GPU the card is named by its device."""
    path = record_measured_backend("cuda", "bfloat16", "separable")
    assert path == choices and json.loads(path.read_text()) == {"cuda": {"bfloat16": "separable"}}
    assert backend_for("auto", CUDA, torch.bfloat16) == "separable"
    assert backend_for("auto", CUDA, torch.float16) == "fft"
    assert backend_for("auto", CUDA, torch.float32) == "fft" and backend_for("auto", CPU, torch.bfloat16) == "fft"
    assert "measured faster on this GPU by tools/gpu_check.py" in describe(CUDA, torch.bfloat16, "auto", "auto", 64)
    record_measured_backend("other card", "float16", "fft")  # another card's beside it, this one's kept
    assert json.loads(path.read_text()) == {"cuda": {"bfloat16": "separable"}, "other card": {"float16": "fft"}}
    with pytest.raises(ValueError, match="fft_backend must be one of"):
        record_measured_backend("cuda", "bfloat16", "fast")


@pytest.mark.parametrize(
    "content",
    ['["separable"]', '{"cuda": {"bfloat16": "os.system"}}', '{"cuda": "separable"}', "{not json", "", "folder"],
)
def test_a_broken_or_foreign_record_counts_as_no_measurement(choices, content):
    choices.parent.mkdir(parents=True)
    if content == "folder":
        choices.mkdir()
    else:
        choices.write_text(content)
    assert backend_for("auto", CUDA, torch.bfloat16) == "fft"


def test_a_record_nested_past_what_json_reads_counts_as_no_measurement(choices):
    choices.parent.mkdir(parents=True)
    choices.write_text("[" * 100_000 + "]" * 100_000)
    assert backend_for("auto", CUDA, torch.bfloat16) == "fft"


def test_recording_never_writes_through_a_planted_link_and_names_a_folder_it_cannot_make(choices, monkeypatch):
    """The temporary file has an unpredictable name (a link planted at any name beside the record is never written
    through), and a link planted at the record's own name is replaced, not followed."""
    choices.parent.mkdir(parents=True)
    victim = choices.parent.parent / "victim.txt"
    victim.write_text("theirs")
    for name in (f".{choices.name}.{os.getpid()}.tmp", choices.name):
        (choices.parent / name).symlink_to(victim)
    record_measured_backend("cuda", "bfloat16", "separable")
    assert victim.read_text() == "theirs" and not choices.is_symlink()
    assert json.loads(choices.read_text()) == {"cuda": {"bfloat16": "separable"}}
    monkeypatch.setenv("XDG_CACHE_HOME", "/dev/null")
    with pytest.raises(OSError, match=r"cannot write the record /dev/null/cat/dft_choices.json"):
        record_measured_backend("cuda", "bfloat16", "fft")
    assert backend_for("auto", CUDA, torch.bfloat16) == "fft"  # and reading it is no measurement


def test_auto_keeps_the_spectra_while_a_deep_model_fits_the_budget():
    assert lean_for("auto", 10, 10 * AUTO_DEPTH) is False
    assert lean_for("auto", 11, 10 * AUTO_DEPTH) is True
    assert lean_for(True, 1, 2**40) is True and lean_for(False, 2**40, 1) is False


def test_the_budget_is_a_share_of_free_memory_unless_set():
    free_share = default_budget_bytes("cpu")
    assert free_share > 0 and default_budget_bytes("cpu") == free_share  # read once
    meminfo = {line.split(":")[0]: int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()}
    assert free_share <= BUDGET_SHARE * meminfo["MemTotal"] * 1024
    assert budget_bytes(None, CPU) == free_share and budget_bytes(3, CPU) == 3 * 2**20


def test_the_start_line_says_what_is_taken_and_why(choices):
    line = describe(CPU, torch.float32, "auto", "auto", 512)
    assert line.startswith(
        "circulant attention on cpu in float32: the ATen path (attention_kernel=auto: the Triton kernels on CUDA); "
        "on the ATen path, stored spectra while a 24-block model's"
    )
    assert "0.5 GiB, 512 MiB" in line and "fft DFTs (torch.fft in float32; GEMM DFTs were measured slower" in line
    gpu = describe(CUDA, torch.bfloat16, True, "auto", 1024)
    assert "the lean function (lean_attention=true)" in gpu and "fft DFTs (torch.fft in float32, the fewest" in gpu
    assert "this GPU has not measured the separable GEMMs (tools/gpu_check.py)" in gpu
    assert "the Triton kernels for grids up to 16x16 in training and 32x32 in inference" in gpu
    assert "the Triton kernels (attention_kernel=triton)" in describe(CPU, torch.float32, "auto", "auto", 512, "triton")
