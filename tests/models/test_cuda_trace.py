"""Every model's compiled training step, traced for CUDA on a machine with no GPU (cat.toolkit.fake_cuda): no operator
in the graph makes a tensor on the host or copies one to the device, in float32 and under bf16 autocast, with each DFT
backend, stored or lean. A host tensor in a CUDA graph is work Inductor cuts out of the CUDA graph, and its copy to the
device makes the host wait for the GPU in every block of every step."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F

import cat
from cat.ops import configure_attention
from cat.toolkit.fake_cuda import fake_cuda_step, host_nodes
from tests.conftest import quick_few

# Each model small enough to trace in seconds, with every kind of block its family has.
MODELS = {
    "ca_deit_tiny": ("ca_deit_tiny", {"img_size": 32, "depth": 2}, 32),
    "ca_pvt_tiny": ("ca_pvt_tiny", {"depths": (1, 1, 1, 1)}, 64),
    "ca_swin_tiny": ("ca_swin_tiny", {"depths": (1, 1, 1, 1), "img_size": 64, "window_size": 2}, 64),
    "cat_tiny": ("cat_tiny", {"depths": (1, 1, 1, 1)}, 64),
    "converted": ("deit_tiny_patch16_224", {"img_size": 32, "depth": 2}, 32),
}
# (bf16 autocast, DFT backend or the Triton kernels, lean): the kernels are one custom operator each way. Every DFT
# backend under bf16 autocast (a float32 graph is its bf16 graph less autocast's casts: tests/ops/test_cost.py), and
# in float32 the attentions a float32 CUDA run takes (the FFT, stored or lean, and the kernels).
SETTINGS = [(1, backend, lean) for backend in ("fft", "separable", "matmul") for lean in (0, 1)]
SETTINGS += [(0, "fft", 0), (0, "fft", 1), (1, "triton", 0), (0, "triton", 0)]
# Traced lean, a model's graphs are its stored graphs less the attention (the lean function runs uncompiled): the
# other families are traced stored under bf16 autocast, with the two attentions a CUDA run takes by default (the FFT
# and the kernels). The GEMM DFTs, taken only where a card measured them faster, are the same function in every
# family's blocks, traced in CA-DeiT-T's SETTINGS.
STORED = [(1, "fft", 0), (1, "triton", 0)]


def training_step(amp: bool):
    def step(model, images, targets):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(images), targets)
        return loss

    return step


@pytest.mark.parametrize("name", quick_few(list(MODELS), {"ca_deit_tiny"}))
def test_a_compiled_cuda_training_step_holds_no_host_tensor_and_no_copy(name):
    timm_name, kwargs, res = MODELS[name]
    found = {}
    for amp, backend, lean in SETTINGS if name == "ca_deit_tiny" else STORED:
        torch.manual_seed(0)
        model = timm.create_model(timm_name, num_classes=5, **kwargs)
        if name == "converted":
            cat.convert(model)
        # A fixed memory budget: a fake CUDA device has no free memory to read.
        if backend == "triton":
            configure_attention(model, False, "auto", 1024, "triton")
        else:
            configure_attention(model, bool(lean), backend, 1024, "aten")
        traced = fake_cuda_step(model, training_step(bool(amp)), (2, 3, res, res), 5, fullgraph=not lean)
        assert traced.graphs and traced.output.device.type == "cuda"
        # The attention is traced in: the fused function's backward included (unless lean: run uncompiled), or the
        # kernels' operator.
        bodies = [n for n in traced.nodes if n.op == "get_attr" and str(n.target).startswith("bwd_body")]
        kernels = [n for n in traced.nodes if "circulant_kernel_forward" in str(n.target)]
        assert bool(kernels) if backend == "triton" else bodies or lean, (amp, backend, lean)
        found[(amp, backend, lean)] = host_nodes(traced.nodes)
    assert all(not nodes for nodes in found.values()), {k: v[:3] for k, v in found.items() if v}


def test_the_check_finds_a_host_constant():
    """The check itself: a block that builds a constant on the CPU and copies it over is found, node by node."""

    class HostConstant(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 5)

        def forward(self, x):
            return self.linear(x.mean((2, 3))) + torch.arange(5.0).to(x.device)

    traced = fake_cuda_step(HostConstant(), training_step(False), (2, 4, 3, 3), 5)
    found = host_nodes(traced.nodes)
    assert len(found) == 2 and "arange" in found[0] and "(cpu)" in found[0] and "(cpu -> cuda)" in found[1], found
