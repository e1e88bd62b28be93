"""Circulant attention's Triton kernels (cat.ops.kernels), run by Triton's interpreter on this CPU against the ATen
path and a float64 reference, and compiled ahead of time for the CUDA cards ``auto`` gives them to."""

from __future__ import annotations

import logging

import pytest
import timm
import torch

import cat
from cat.ops import circulant_attention, set_attention_kernel
from cat.ops.kernels import check, launch
from cat.ops.kernels.check import use_kernels
from cat.ops.kernels.launch import circulant_kernel, circulant_kernel_qkv, kernel_forward, projected_kernel
from cat.ops.policy import KERNEL_INFERENCE_TILE, KERNEL_TRAINING_TILE, kernel_for, tile_of

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def reference(q, k, v, hw, head_dim, scale=None):
    """The ATen path in float64 on tokens (B, N, C)."""
    B, N, C = q.shape
    maps = (t.double().reshape(B, *hw, C) for t in (q, k, v))
    return circulant_attention(*maps, head_dim=head_dim, scale=scale).reshape(B, N, C)


def relative(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize(
    "hw, channels, head_dim",
    [((4, 6), 4, 1), ((7, 10), 4, 2), ((14, 14), 3, 1), ((24, 24), 2, 1), ((28, 28), 2, 2), ((56, 56), 1, 1)],
)
def test_the_kernels_compute_the_operator_and_its_gradients_in_float32(hw, channels, head_dim):
    """Forward and the three input gradients within 1e-5 of float64 (exact float32 GEMMs), on square, non-square and
    non-power-of-two grids, per channel and in heads; q, k, v as the chunks of one projection (strided)."""
    torch.manual_seed(0)
    B, N = 2, hw[0] * hw[1]
    qkv = torch.randn(B, N, 3 * channels, requires_grad=True)
    q, k, v = qkv.chunk(3, dim=-1)
    out = circulant_kernel(q, k, v, hw, head_dim)
    g = torch.randn_like(out)
    (g_kernel,) = torch.autograd.grad(out, qkv, g)
    ref = reference(q, k, v, hw, head_dim)
    (g_ref,) = torch.autograd.grad(ref, qkv, g.double())
    assert out.dtype == torch.float32 and out.shape == (B, N, channels)
    assert relative(out, ref) < 1e-5
    for part, part_ref in zip(g_kernel.chunk(3, -1), g_ref.chunk(3, -1), strict=True):
        assert relative(part, part_ref) < 1e-5


@pytest.mark.parametrize("hw, channels, head_dim", [((7, 10), 4, 2), ((14, 14), 3, 1)])
def test_the_gate_in_the_kernels_epilogue_gives_the_gated_operator_and_its_gradients(hw, channels, head_dim):
    """With the gate's pre-activation a as the projection's last C channels and its bias b, the kernels compute
    out * SiLU(a + b) and the gradients of q, k, v, a and b (the backward recomputing the ungated output), within
    1e-5 of float64."""
    torch.manual_seed(0)
    B, N = 2, hw[0] * hw[1]
    qkvg = torch.randn(B, N, 4 * channels, requires_grad=True)
    bias = torch.randn(channels, requires_grad=True)
    q, k, v, gate = qkvg.chunk(4, dim=-1)
    out = circulant_kernel_qkv(qkvg, hw, head_dim, gated=True, gate_bias=bias)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qkvg, bias), g)
    ref = reference(q, k, v, hw, head_dim) * torch.nn.functional.silu(gate.double() + bias.double())
    grads_ref = torch.autograd.grad(ref, (qkvg, bias), g.double())
    assert relative(out, ref) < 1e-5
    for mine, theirs in zip(grads, grads_ref, strict=True):
        assert relative(mine, theirs) < 1e-5


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["gate_bias", "joined_bias"])
def test_making_the_projection_again_in_the_backward_gives_what_keeping_it_gives(amp, with_bias):
    """projected_kernel keeps x and the weights, not the (B, N, 4C) projection, and makes it again in the backward:
    the output and every gradient equal those of the kept projection (F.linear, then the kernels), in float32 and
    under bf16 autocast, with the gate's bias in the kernels or a bias joined to the projection's."""
    torch.manual_seed(0)
    hw, C = (3, 5), 4
    x = torch.randn(2, 15, C, requires_grad=True)
    weight = torch.randn(4 * C, C, requires_grad=True)
    bias = torch.randn(4 * C, requires_grad=True) if with_bias else None
    gate_bias = None if with_bias else torch.randn(C, requires_grad=True)
    leaves = [t for t in (x, weight, bias, gate_bias) if t is not None]
    g = torch.randn(2, 15, C)
    results = []
    for recompute in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            if recompute:
                out = projected_kernel(x, weight, bias, gate_bias, hw)
            else:
                qkvg = torch.nn.functional.linear(x, weight, bias)
                out = circulant_kernel_qkv(qkvg, hw, gated=True, gate_bias=gate_bias)
        results.append((out, torch.autograd.grad(out, leaves, g.to(out.dtype))))
    (out, grads), (kept_out, kept_grads) = results
    assert out.dtype == (torch.bfloat16 if amp else torch.float32)
    torch.testing.assert_close(out, kept_out, rtol=0, atol=0)
    for mine, kept in zip(grads, kept_grads, strict=True):
        assert mine.dtype == kept.dtype
        torch.testing.assert_close(mine, kept, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"weight \(4C, C\) needed; got \(2, 15, 4\) and \(12, 4\)"):
        projected_kernel(x, weight[:12], None, None, hw)


def test_a_64_by_64_grid_and_an_explicit_scale():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 64 * 64, 1) for _ in range(3))
    assert relative(circulant_kernel(q, k, v, (64, 64), 1, 0.01), reference(q, k, v, (64, 64), 1, 0.01)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_accumulate_in_float32(dtype):
    """bf16 and fp16 inputs: the result in their dtype, within the tolerance tools/gpu_check.py holds the ATen path to
    under autocast (1e-2 for outputs, 5e-2 for gradients), against float64 on the same rounded inputs; the gate in the
    epilogue."""
    torch.manual_seed(0)
    q, k, v, gate = (torch.randn(2, 14 * 14, 4).to(dtype).requires_grad_() for _ in range(4))
    out = circulant_kernel(q, k, v, (14, 14), 1, gate=gate)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, gate), g)
    ref = reference(q, k, v, (14, 14), 1) * torch.nn.functional.silu(gate.double())
    grads_ref = torch.autograd.grad(ref, (q, k, v, gate), g.double())
    assert out.dtype == dtype and relative(out, ref) < 1e-2
    assert all(relative(a, b) < 5e-2 for a, b in zip(grads, grads_ref, strict=True))


def test_the_operators_are_registered_with_fake_implementations_and_autograd():
    """torch.library's own check of the forward operator: its fake implementation, its schema and autograd formula
    agree with what it computes (torch.compile then keeps it one opaque node), with the gate and without."""
    torch.manual_seed(0)
    qkv = torch.randn(1, 12, 6, requires_grad=True)
    torch.library.opcheck(kernel_forward, (qkv, None, False, 3, 4, 1, 12**-0.5, "ieee"))
    qkvg = torch.randn(1, 12, 8, requires_grad=True)
    bias = torch.randn(2, requires_grad=True)
    for gate_bias in (None, bias):
        torch.library.opcheck(kernel_forward, (qkvg, gate_bias, True, 3, 4, 1, 12**-0.5, "ieee"))


def test_a_projection_or_gate_bias_of_the_wrong_shape_is_named():
    with pytest.raises(ValueError, match=r"must be \(B, N, 4C\); got \(1, 12, 6\)"):
        kernel_forward(torch.randn(1, 12, 6), None, True, 3, 4, 1, 0.3, "ieee")
    with pytest.raises(ValueError, match=r"a gate bias needs the gate and shape \(2,\); got \(3,\)"):
        kernel_forward(torch.randn(1, 12, 8), torch.randn(3), True, 3, 4, 1, 0.3, "ieee")


MODELS = {
    "ca_deit_tiny": ("ca_deit_tiny", {"img_size": 32, "depth": 2, "embed_dim": 16, "patch_size": 4}),
    "head_dim_4": ("ca_deit_tiny", {"img_size": 32, "depth": 1, "embed_dim": 16, "patch_size": 4, "head_dim": 4}),
    "converted": ("deit_tiny_patch16_224", {"img_size": 32, "depth": 1, "embed_dim": 24, "patch_size": 8}),
    "ca_pvt_tiny": ("ca_pvt_tiny", {"depths": (1, 1, 1, 1), "embed_dims": (8, 16, 40, 64)}),
}


@pytest.mark.parametrize("name", MODELS)
def test_a_model_through_the_kernels_gives_the_aten_path_logits_and_gradients(name):
    """Whole models with attention_kernel=triton against aten: CA-DeiT, grouped heads, a converted ViT (class token
    and qkv bias: the prefix tokens and the bias pass around the kernels) and CA-PVT (a class token in its last
    stage, circulant blocks in the first two)."""
    timm_name, kwargs = MODELS[name]
    torch.manual_seed(0)
    model = timm.create_model(timm_name, num_classes=5, **kwargs)
    if name == "converted":
        cat.convert(model)
    model.eval()  # no stochastic depth: both paths see the same network (gradients flow all the same)
    x = torch.randn(2, 3, 32, 32) if name != "ca_pvt_tiny" else torch.randn(2, 3, 64, 64)
    results = {}
    for kernel in ("aten", "triton"):
        set_attention_kernel(model, kernel)
        model.zero_grad(set_to_none=True)
        logits = model(x)
        logits.square().sum().backward()
        results[kernel] = (logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
    (aten_logits, aten_grads), (kernel_logits, kernel_grads) = results["aten"], results["triton"]
    torch.testing.assert_close(kernel_logits, aten_logits, rtol=1e-5, atol=1e-5)
    assert len(kernel_grads) == len(aten_grads)
    for a, b in zip(kernel_grads, aten_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_released_ca_deit_through_the_kernels_gives_its_logits(official_ca_deit):
    """The authors' checkpoint fixture: the kernels' logits equal the release's within 1e-5 (float32)."""
    from tests.models.test_deit import FIXTURE_ARGS

    model = cat.create_model("ca_deit_tiny", checkpoint=official_ca_deit / "small_p8_64.pth", **FIXTURE_ARGS).eval()
    set_attention_kernel(model, "triton")
    io = torch.load(official_ca_deit / "small_p8_64.io.pth", weights_only=True)
    with torch.no_grad():
        logits = model(io["input"])
    torch.testing.assert_close(logits, io["logits"], rtol=1e-5, atol=1e-5)


def test_auto_takes_the_kernels_on_cuda_for_the_grids_they_hold(monkeypatch):
    """The rule (cat.ops.policy.kernel_for), decided without a GPU: a CPU keeps ATen; on CUDA the kernels train grids
    whose tile is at most 16 and infer up to 32; 'triton' and 'aten' are obeyed anywhere; a card measured faster on
    ATen, or whose kernels failed their check, keeps ATen."""
    monkeypatch.setitem(check._verdicts, "cuda", True)
    monkeypatch.setattr("cat.ops.policy.measured_kernel", lambda device: None)
    bf16, fp32 = torch.bfloat16, torch.float32
    assert (KERNEL_TRAINING_TILE, KERNEL_INFERENCE_TILE) == (16, 32)
    assert not kernel_for("auto", CPU, (14, 14), True, bf16)
    assert kernel_for("auto", CUDA, (14, 14), True, bf16) and kernel_for("auto", CUDA, (7, 10), True, fp32)
    assert not kernel_for("auto", CUDA, (24, 24), True, bf16) and kernel_for("auto", CUDA, (24, 24), False, bf16)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:  # a process-wide setting: put back whatever happens
        torch.backends.cuda.matmul.allow_tf32 = False
        assert not kernel_for("auto", CUDA, (24, 24), False, fp32)  # exact float32 GEMMs: 16 x 16 tiles only
        torch.backends.cuda.matmul.allow_tf32 = True
        assert kernel_for("auto", CUDA, (24, 24), False, fp32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert not kernel_for("auto", CUDA, (64, 64), False, bf16) and not kernel_for("auto", CUDA, (56, 56), True, bf16)
    assert kernel_for("triton", CPU, (64, 64), True, fp32) and not kernel_for("aten", CUDA, (14, 14), True, bf16)
    monkeypatch.setitem(check._verdicts, "cuda", False)  # the kernels failed their first check on this card
    assert kernel_for("auto", CUDA, (14, 14), True, bf16) and not use_kernels("auto", CUDA, (14, 14), True, bf16)
    assert use_kernels("triton", CUDA, (14, 14), True, bf16)  # asked for by name: no check
    monkeypatch.setitem(check._verdicts, "cuda", True)
    assert use_kernels("auto", CUDA, (14, 14), True, bf16)
    monkeypatch.setattr("cat.ops.policy.measured_kernel", lambda device: "aten")
    assert not kernel_for("auto", CUDA, (14, 14), True, bf16)
    assert [tile_of(s) for s in (7, 14, 16, 17, 24, 56, 64)] == [16, 16, 16, 32, 32, 64, 64]


def test_the_first_use_check_falls_back_in_one_line_on_an_error_or_a_mismatch(monkeypatch, caplog):
    """The check passes for the kernels as they are (here through the interpreter); a kernel that raises or computes
    something else is turned off for the process with one warning naming the card and the reason."""
    assert check.compare_with_aten(CPU) < 1e-5
    assert check.kernels_work("cpu")
    for device, failure in (("cpu:1", RuntimeError("ptxas fatal: out of registers")), ("cpu:2", 0.5)):

        def broken(device, failure=failure):
            if isinstance(failure, Exception):
                raise failure
            return failure

        monkeypatch.setattr(check, "compare_with_aten", broken)
        with caplog.at_level(logging.WARNING, logger="cat"):
            assert not check.kernels_work(device)
    lines = [r.getMessage() for r in caplog.records if "Triton kernels are off" in r.getMessage()]
    assert len(lines) == 2
    assert "RuntimeError: ptxas fatal: out of registers" in lines[0] and "relative error 5.0e-01" in lines[1]
    assert all("the ATen path runs instead" in line for line in lines)


# What auto hands the kernels at 224^2 (CA-DeiT: 14 x 14, trained and inferred, in each dtype and GEMM precision a
# run can give them), 384^2 (24 x 24, inferred on the tensor cores) and 1024^2 (64 x 64: none, the ATen path); the
# models' kernels with the gate and its bias in them, and a converted ViT's (class token: gated outside) at the two
# ends of the precisions.
PRECISIONS = ((torch.float32, "ieee"), (torch.float32, "tf32"), (torch.bfloat16, "tf32"), (torch.float16, "tf32"))
AOT_CASES = [(name, (14, 14), *p, True) for name in ("forward", "backward") for p in PRECISIONS]
AOT_CASES += [("forward", (24, 24), *p, True) for p in PRECISIONS if p[1] == "tf32"]
AOT_CASES += [(name, (14, 14), *p, False) for name in ("forward", "backward") for p in PRECISIONS[::2]]
SHARED_MEMORY = {80: 163 * 1024, 90: 227 * 1024}  # the most a block may use (A100, H100)


@pytest.mark.slow  # Triton's compiler and ptxas: about two seconds a case
@pytest.mark.parametrize("capability", [80, 90])
def test_every_configuration_auto_picks_compiles_for_the_cards_without_spills(
    capability, tmp_path, monkeypatch, capsys
):
    """Compiled ahead of time for sm_80 and sm_90 with no GPU present: each configuration builds, the report of the
    ptxas run that built it (Triton's own, with its flags) says no register spilled, and its shared memory fits the
    card; at 1024^2 auto takes the ATen path (no configuration)."""
    import triton

    assert not kernel_for("auto", CUDA, (64, 64), False, torch.bfloat16)
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "triton"))  # every case built, none found cached
    monkeypatch.setattr(triton.knobs.nvidia, "dump_ptxas_log", True)  # Triton prints ptxas's -v report
    for name, hw, dtype, precision, gated in AOT_CASES:
        capsys.readouterr()
        kernel = launch.compiled_for(f"circulant_{name}_kernel", hw, dtype, capability, precision, gated=gated)
        report = capsys.readouterr().out
        case = (name, hw, dtype, precision, gated)
        assert f"for 'sm_{capability}" in report and "spill stores" in report, (case, report)
        assert "0 bytes spill stores, 0 bytes spill loads" in report, (case, report)
        assert kernel.metadata.shared <= SHARED_MEMORY[capability], (case, kernel.metadata.shared)
